//! Kilo's flags as kg parses, validates and warns about them.
use rstest::rstest;

use super::*;

#[test]
fn kilo_defaults() {
    let f = Flags::try_parse_from(["kg"]).unwrap();
    assert_eq!(f.backend, BackendKind::Kubernetes);
    assert!(f.clean_up && !f.clean_up_interface && f.create_interface && f.local && f.cni);
    assert_eq!(f.interface, "kilo0");
    assert_eq!(f.listen, "[::]:1107".parse().unwrap());
    assert!(f.command.is_none());
    assert_eq!(f.mtu, Mtu::Auto);
    assert_eq!(f.port, 51820);
    assert_eq!(f.subnet, "10.4.0.0/16".parse::<IpNet>().unwrap());
    assert_eq!(f.resync(), Some(Duration::from_secs(30)));
    assert_eq!(f.mesh_granularity, Granularity::Location);
    assert_eq!(f.encapsulate, Encapsulate::Always);
    assert_eq!(f.topology_label, "topology.kubernetes.io/region");
    assert_eq!(f.private_key, PathBuf::from("/var/lib/kilo/key"));
    assert!(f.seccomp && !f.dry_run);
    let dp = crate::datapath::DatapathConfig::default();
    assert_eq!(
        (f.datapath_max_entries, f.datapath_counter_slots),
        (dp.max_entries, dp.counter_slots)
    );
    assert_eq!(f.log_format, LogFormat::Json);
    assert!(f.warnings().is_empty());
    let f = Flags::try_parse_from(["kg", "--log-format=text"]).unwrap();
    assert_eq!(f.log_format, LogFormat::Text);
    assert!(Flags::try_parse_from(["kg", "--log-format=logfmt"]).is_err());
}

#[test]
fn go_style_flags() {
    let f = Flags::try_parse_from([
        "kg",
        "--clean-up=false",
        "--clean-up-interface",
        "--resync-period=1m30s",
        "--mtu=1380",
        "--service-cidr=10.96.0.0/12",
        "--service-cidr=fd00:96::/108",
        "--mesh-granularity=cross",
        "--backend=file",
        "--backend-dir=/tmp/x",
        "--iptables-forward-rules=true",
        "--log-level=all",
    ])
    .unwrap();
    assert!(!f.clean_up && f.clean_up_interface);
    assert_eq!(f.resync_period, Duration::from_secs(90));
    assert_eq!(f.mtu, Mtu::Fixed(1380));
    assert_eq!(f.service_cidr.len(), 2);
    assert!(f.validate().is_ok());
    assert!(f.warnings().is_empty(), "{:?}", f.warnings());
    // Kilo adds its FORWARD rules only as the CNI.
    let f = Flags::try_parse_from(["kg", "--iptables-forward-rules", "--cni=false"]).unwrap();
    assert_eq!(f.warnings().len(), 1);
    assert!(f.warnings()[0].contains("--cni=false"));
    // Kilo's repeatable flags also take comma-separated values.
    let f = Flags::try_parse_from([
        "kg",
        "--service-cidr=10.96.0.0/12,fd00:96::/108",
        "--service-cidr=10.97.0.0/16",
        "--internal-cidr=10.0.0.0/8,192.168.0.0/16",
        "--datapath-interface=cni0,kube-bridge",
    ])
    .unwrap();
    assert_eq!(f.service_cidr.len(), 3);
    assert_eq!(f.internal_cidr.len(), 2);
    assert_eq!(f.datapath_interfaces, ["cni0", "kube-bridge"]);
    let f = Flags::try_parse_from(["kg", "--compatibility=flannel"]).unwrap();
    assert_eq!(f.compatibility, Compatibility::Flannel);
    assert!(Flags::try_parse_from(["kg", "--compatibility=calico"]).is_err());
    assert!(matches!(
        Flags::try_parse_from(["kg", "version"]).unwrap().command,
        Some(KgCommand::Version)
    ));
    assert_eq!(
        parse_listen("127.0.0.1:9").unwrap(),
        "127.0.0.1:9".parse().unwrap()
    );
    let f = Flags::try_parse_from(["kg", "--resync-period=0"]).unwrap();
    assert_eq!(f.resync(), None);
    let f = Flags::try_parse_from(["kg", "--backend=file"]).unwrap();
    assert!(f.validate().unwrap_err().contains("--backend-dir"));
    assert!(Flags::try_parse_from(["kg", "--mesh-granularity=ring"]).is_err());
}

fn parse(args: &[&str]) -> Result<Flags, String> {
    Flags::try_parse_from(std::iter::once("kg").chain(args.iter().copied()))
        .map_err(|e| e.to_string())
}

/// Every boolean flag takes Go's `strconv.ParseBool` forms after `=`, and is true alone.
#[rstest]
#[case::one("1", true)]
#[case::t("t", true)]
#[case::upper_t("T", true)]
#[case::upper_true("TRUE", true)]
#[case::lower_true("true", true)]
#[case::title_true("True", true)]
#[case::zero("0", false)]
#[case::f("f", false)]
#[case::upper_f("F", false)]
#[case::upper_false("FALSE", false)]
#[case::lower_false("false", false)]
#[case::title_false("False", false)]
fn go_booleans(#[case] value: &str, #[case] want: bool) {
    let bools = |f: &Flags| {
        [
            f.clean_up,
            f.clean_up_interface,
            f.cni,
            f.create_interface,
            f.local,
            f.prioritise_private_addresses,
            f.dry_run,
            f.seccomp,
            f.iptables_forward_rules,
            f.fast_path,
            f.datapath,
        ]
    };
    let names = [
        "clean-up",
        "clean-up-interface",
        "cni",
        "create-interface",
        "local",
        "prioritise-private-addresses",
        "dry-run",
        "seccomp",
        "iptables-forward-rules",
        "fast-path",
        "datapath",
    ];
    let args: Vec<String> = names.iter().map(|n| format!("--{n}={value}")).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_eq!(bools(&parse(&args).unwrap()), [want; 11], "{value}");
    let alone: Vec<String> = names.iter().map(|n| format!("--{n}")).collect();
    let alone: Vec<&str> = alone.iter().map(String::as_str).collect();
    assert_eq!(bools(&parse(&alone).unwrap()), [true; 11]);
}

#[rstest]
#[case::yes("yes")]
#[case::on("on")]
#[case::mixed_case("tRUE")]
#[case::empty("")]
#[case::two("2")]
fn go_booleans_refused(#[case] value: &str) {
    let e = parse(&[&format!("--clean-up={value}")]).unwrap_err();
    assert!(
        e.contains("--clean-up") && e.contains("expected true or false"),
        "{e}"
    );
}

/// As in pflag, a boolean never takes the next word: it is the next argument.
#[test]
fn go_boolean_leaves_the_next_word() {
    let f = parse(&["--clean-up-interface", "version"]).unwrap();
    assert!(f.clean_up_interface);
    assert!(matches!(f.command, Some(KgCommand::Version)));
    assert!(parse(&["--clean-up", "false"]).is_err());
}

#[rstest]
#[case::all_addresses(":1107", "[::]:1107")]
#[case::ipv4("127.0.0.1:9", "127.0.0.1:9")]
#[case::ipv6("[::1]:1107", "[::1]:1107")]
#[case::host_name("localhost:1107", "127.0.0.1:1107")]
#[case::any_port(":0", "[::]:0")]
fn listen_addresses(#[case] flag: &str, #[case] want: &str) {
    assert_eq!(parse_listen(flag).unwrap(), want.parse().unwrap());
    let f = parse(&[&format!("--listen={flag}")]).unwrap();
    assert_eq!(f.listen, want.parse().unwrap());
}

#[rstest]
#[case::no_port("1107", "no port")]
#[case::empty_port("localhost:", "not a number")]
#[case::port_too_big(":65536", "not a number from 0 to 65535")]
#[case::service_name(":http", "not a number")]
#[case::signed_port(":+80", "not a number")]
#[case::bare_ipv6("::1:1107", "needs brackets")]
#[case::unclosed_bracket("[::1:1107", "not an IPv6 address")]
#[case::ipv4_in_brackets("[127.0.0.1]:1107", "not an IPv6 address")]
fn listen_addresses_refused(#[case] flag: &str, #[case] why: &str) {
    let e = parse_listen(flag).unwrap_err();
    assert!(e.contains(why) && e.contains(flag), "{e}");
    let metrics = format!("--listen-metrics={flag}");
    let e = parse(&["webhook", "--cert-file=c", "--key-file=k", &metrics]).unwrap_err();
    assert!(e.contains("--listen-metrics") && e.contains(why), "{e}");
}

/// Kilo refuses port 0 (and any port outside 1..=65535).
#[rstest]
#[case::zero("0", None)]
#[case::one("1", Some(1))]
#[case::max("65535", Some(65535))]
#[case::too_big("65536", None)]
fn ports(#[case] flag: &str, #[case] want: Option<u16>) {
    match (parse(&[&format!("--port={flag}")]), want) {
        (Ok(f), Some(p)) => assert_eq!(f.port, p),
        (Err(e), None) => assert!(e.contains("--port") && e.contains(flag), "{e}"),
        (got, want) => panic!("--port={flag}: {:?}, want {want:?}", got.map(|f| f.port)),
    }
}

/// `--mtu` as Kilo's `strconv.ParseUint(s, 10, 32)`; below IPv6's 1280 with a warning.
#[rstest]
#[case::auto("auto", Some(Mtu::Auto), false)]
#[case::usual("1380", Some(Mtu::Fixed(1380)), false)]
#[case::ipv6_minimum("1280", Some(Mtu::Fixed(1280)), false)]
#[case::small("12", Some(Mtu::Fixed(12)), true)]
#[case::zero("0", Some(Mtu::Fixed(0)), true)]
#[case::leading_zero("01420", Some(Mtu::Fixed(1420)), false)]
#[case::jumbo("65536", Some(Mtu::Fixed(65536)), false)]
#[case::max("4294967295", Some(Mtu::Fixed(u32::MAX)), false)]
#[case::over_32_bits("4294967296", None, false)]
#[case::signed("+1380", None, false)]
#[case::negative("-1", None, false)]
#[case::word("big", None, false)]
fn mtus(#[case] flag: &str, #[case] want: Option<Mtu>, #[case] warned: bool) {
    match (parse(&[&format!("--mtu={flag}")]), want) {
        (Ok(f), Some(m)) => {
            assert_eq!(f.mtu, m);
            let w = f.warnings();
            assert_eq!(w.len(), usize::from(warned), "{w:?}");
            assert!(w.iter().all(|w| w.contains("1280")), "{w:?}");
        }
        (Err(e), None) => assert!(e.contains("--mtu") && e.contains(flag), "{e}"),
        (got, want) => panic!("--mtu={flag}: {:?}, want {want:?}", got.map(|f| f.mtu)),
    }
}

/// `kg completion SHELL` is parsed, and each shell's script names kg's subcommands and flags.
#[rstest]
#[case::bash("bash", Shell::Bash)]
#[case::zsh("zsh", Shell::Zsh)]
#[case::fish("fish", Shell::Fish)]
#[case::powershell("powershell", Shell::Powershell)]
fn completion_scripts(#[case] name: &str, #[case] shell: Shell) {
    let f = parse(&["completion", name]).unwrap();
    assert!(matches!(f.command, Some(KgCommand::Completion { shell: s }) if s == shell));
    let mut out = Vec::new();
    shell.write(<Flags as clap::CommandFactory>::command(), &mut out);
    let script = String::from_utf8(out).unwrap();
    for word in [
        "kg",
        "webhook",
        "completion",
        "clean-up",
        "listen-metrics",
        "mtu",
    ] {
        assert!(script.contains(word), "{name}: {word}");
    }
    assert!(parse(&["completion", "elvish"]).is_err());
}

#[test]
fn durations() {
    assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
    assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
    assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
    for bad in ["", "30", "s", "3x", "-1s"] {
        assert!(parse_duration(bad).is_err(), "{bad}");
    }
}
