//! The loop under tokio's paused clock with the in-memory kernel, for the agent's tests.
use super::*;

/// Unix seconds at a test's start.
pub const T0: i64 = 1_000_000;

/// Each plan: its time (ms since the start) and the nodes it was given.
pub type Plans = Arc<Mutex<Vec<(u128, Vec<String>)>>>;

pub struct Running {
    pub plans: Plans,
    pub stop: tokio::sync::oneshot::Sender<()>,
    pub run: tokio::task::JoinHandle<Stats>,
    pub metrics: Metrics,
}

/// The test loop's node, `me`.
pub fn local() -> Local {
    Local {
        hostname: "me".into(),
        public_key: Key([1; 32]),
        endpoint: None,
        internal_ip: None,
        granularity: "location".into(),
        cni_compatibility_ip: None,
    }
}

/// A plan (empty).
pub fn planned() -> PlanOutcome {
    PlanOutcome {
        plan: Some(Plan::default()),
        ..PlanOutcome::default()
    }
}

/// The unix clock of a test: [`T0`] at the start, then tokio's (paused) time.
pub fn clock(begin: tokio::time::Instant) -> Clock {
    Clock::new(move || T0 * 1000 + begin.elapsed().as_millis() as i64)
}

pub type FakeReconciler = Reconciler<
    crate::reconcile::FakeKernel,
    crate::reconcile::wireguard::FakeWireGuard,
    crate::datapath::FakeDatapath,
>;

/// Reconcilers on fakes, with the WireGuard device kilo0 and no other.
pub fn reconciler() -> FakeReconciler {
    Reconciler::new(
        crate::reconcile::FakeKernel::default(),
        crate::reconcile::wireguard::FakeWireGuard::default(),
        crate::datapath::FakeDatapath::default(),
        crate::reconcile::DeviceSettings {
            devices: crate::plan::Devices {
                wireguard: "kilo0".into(),
                private: None,
                tunnel: None,
            },
            create_interface: true,
            mtu: None,
            private_key: Key([7; 32]),
            dns: Box::new(crate::reconcile::wireguard::system_resolver),
        },
    )
}

/// Spawns the loop of node `me` on `backend` with `settings` (and [`clock`]); the planner
/// records each plan and answers `outcome()`.
pub fn spawn(
    backend: Arc<dyn Backend>,
    settings: LoopSettings,
    outcome: impl Fn() -> PlanOutcome + Send + 'static,
) -> Running {
    let begin = tokio::time::Instant::now();
    let plans = Plans::default();
    let recorded = plans.clone();
    let planner = move |s: &Snapshot| {
        recorded.lock().unwrap().push((
            begin.elapsed().as_millis(),
            s.nodes.keys().cloned().collect(),
        ));
        outcome()
    };
    let reconciler = reconciler();
    let local = local();
    let settings = LoopSettings {
        clock: clock(begin),
        ..settings
    };
    let metrics = Metrics::new();
    let mut agent = Agent::new(
        backend,
        planner,
        reconciler,
        local,
        settings,
        metrics.clone(),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        agent
            .run(None, async {
                let _ = stopped.await;
            })
            .await
    });
    Running {
        plans,
        stop,
        run,
        metrics,
    }
}
