# The same image `cargo xtask image` assembles without Docker: static kg and kgctl on an empty
# base, for linux/amd64, linux/arm64 and linux/arm/v7. Run `cargo xtask image` first (it builds
# the binaries and leaves each architecture's root in target/image/bundle-<arch>), then
#   docker buildx build --platform linux/amd64,linux/arm64,linux/arm/v7 -t REGISTRY/kilo-rs:0.1.0 .
FROM scratch
ARG TARGETARCH
ARG TARGETVARIANT
COPY target/image/bundle-${TARGETARCH}${TARGETVARIANT}/rootfs/usr/bin/ /usr/bin/
ENTRYPOINT ["/usr/bin/kg"]
