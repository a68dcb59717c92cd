//! The e2e scenario: a Peer applied with kubectl, configured with `kgctl showconf peer` on an outside host.
use super::*;

impl Cluster {
    /// The host `ext` (outside the cluster, on the public side) gets a wireguard-go device, a
    /// Peer named after it, and the configuration `kgctl showconf peer` prints for it.
    pub(super) fn peer(&self) -> Result<String> {
        const IFACE: &str = "krse2e0";
        const ADDRESS: &str = "10.5.0.1/32";
        run(Command::new("bash")
            .arg(&self.script)
            .args(["ext-wireguard", WORK, IFACE]))?;
        let key_file = self.work.join("ext.key");
        let key = output(Command::new("wg").arg("genkey"))?;
        std::fs::write(&key_file, &key)?;
        let public = output_in(Command::new("wg").arg("pubkey"), &key)?;
        self.apply(&json!({
            "apiVersion": "kilo.squat.ai/v1alpha1", "kind": "Peer", "metadata": {"name": "ext"},
            "spec": {
                "allowedIPs": [ADDRESS], "publicKey": public.trim(), "persistentKeepalive": 10,
            },
        }))?;
        let conf = output(self.kgctl().args(["showconf", "peer", "ext"]))?;
        if !conf.contains("[Peer]") {
            bail!("kgctl showconf peer ext printed {conf:?}");
        }
        let conf_file = self.work.join("ext.conf");
        std::fs::write(&conf_file, &conf)?;
        let ext = |args: &[&str]| {
            run(Command::new("nsenter")
                .arg("--net=/run/netns/krs-e2e-ext")
                .args(args))
        };
        ext(&["wg", "setconf", IFACE, &conf_file.to_string_lossy()])?;
        ext(&[
            "wg",
            "set",
            IFACE,
            "private-key",
            &key_file.to_string_lossy(),
        ])?;
        ext(&["ip", "address", "add", ADDRESS, "dev", IFACE])?;
        ext(&["ip", "link", "set", IFACE, "up"])?;
        ext(&["ip", "route", "add", "10.42.0.0/16", "dev", IFACE])?;
        let mut reached = Vec::new();
        for (name, ip) in self.probe_ips()? {
            wait_for(
                Duration::from_secs(60),
                &format!("ext -> {name} ({ip})"),
                || {
                    Ok(Command::new("nsenter")
                        .arg("--net=/run/netns/krs-e2e-ext")
                        .args(["busybox", "ping", "-c", "1", "-W", "2", &ip])
                        .stdout(Stdio::null())
                        .status()?
                        .success()
                        .then_some(()))
                },
            )?;
            reached.push(name);
        }
        Ok(format!("ext ({ADDRESS}) reached {}", reached.join(", ")))
    }
}
