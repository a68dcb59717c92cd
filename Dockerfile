# The same image `cargo xtask image` assembles without Docker: static kg and kgctl on an empty
# base. Build the binaries first (`cargo xtask image` does, or:
#   cargo build --release --target x86_64-unknown-linux-musl -p kilo-agent --bins
# with `CC_x86_64_unknown_linux_musl=x86_64-linux-musl-gcc` from Debian's musl-tools), then
#   docker build -t kilo-rs:0.1.0 .
FROM scratch
COPY target/x86_64-unknown-linux-musl/release/kg target/x86_64-unknown-linux-musl/release/kgctl /usr/bin/
ENTRYPOINT ["/usr/bin/kg"]
