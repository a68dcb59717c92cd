//! `kg`: the kilo-rs agent. Parses Kilo's flags, builds the agent from them
//! ([`kilo_agent::agent::start`]: key, detection, backend, reconcilers), then runs its event
//! loop until SIGTERM/SIGINT (cleaning up with `--clean-up`). `kg webhook`
//! serves the Peer validation webhook instead ([`kilo_agent::webhook`]). Logs go to stderr
//! as JSON lines (`--log-format=json`, the default, as Kilo logs) or text.
use std::process::ExitCode;

use clap::{CommandFactory as _, Parser as _};
use kilo_agent::agent::{
    config::{Flags, KgCommand, LogFormat, LogLevel},
    start,
};

/// The agent: built from the flags, then run until SIGTERM/SIGINT (or, with `--dry-run`, the
/// difference it would apply, printed).
async fn run(flags: Flags) -> anyhow::Result<()> {
    let started = start::start(&flags).await?;
    if flags.dry_run {
        print!("{}", started.dry_run().await?);
        return Ok(());
    }
    started.run(termination()?).await?;
    Ok(())
}

/// Completes at SIGTERM or SIGINT.
fn termination() -> std::io::Result<impl Future<Output = ()>> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT"),
        }
    })
}

/// Logs to stderr at `--log-level` (or `RUST_LOG`), in `--log-format`. The object loader's
/// own debug chatter (hundreds of relocation lines per load) stays out below `all`; the
/// Kubernetes client's lines about requests and watches (an ERROR for every retry while the
/// API server is down, a WARN for every watch it cuts: the backend reports outages itself)
/// below `debug`, its TLS lines kept.
fn init_logging(flags: &Flags) {
    let directive = match flags.log_level {
        LogLevel::Debug => "debug,aya_obj=info,aya=info".to_string(),
        level @ (LogLevel::All | LogLevel::None) => level.directive().to_string(),
        level => {
            let l = level.directive();
            format!("{l},kube_client::client=off,kube_client::client::tls={l}")
        }
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(directive));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match flags.log_format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .init(),
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
}

fn main() -> ExitCode {
    let flags = Flags::parse();
    match flags.command {
        Some(KgCommand::Version) => {
            println!("{}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        Some(KgCommand::Completion { shell }) => {
            shell.write(Flags::command(), &mut std::io::stdout().lock());
            return ExitCode::SUCCESS;
        }
        _ => {}
    }
    init_logging(&flags);
    if let Some(KgCommand::Webhook(w)) = &flags.command {
        return block_on(async { Ok(start::webhook(w, flags.seccomp, termination()?).await?) });
    }
    if let Err(e) = flags.validate() {
        eprintln!("kg: {e}");
        return ExitCode::from(2);
    }
    for w in flags.warnings() {
        tracing::warn!("{w}");
    }
    block_on(run(flags))
}

/// Runs `f` on a single-threaded runtime; an error is logged and fails the process.
fn block_on(f: impl Future<Output = anyhow::Result<()>>) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kg: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(f);
    // Do not wait for a getaddrinfo still blocked on an unreachable resolver.
    runtime.shutdown_background();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}
