//! The event loop, in the shape of a kube-rs controller: triggers (backend updates, kernel
//! notifications about our objects, the `--resync-period` and check-in timers, the next liveness
//! expiry) wake a [`turn`](Agent::turn) (kube-rs: reconcile) that returns what to do next
//! ([`Action`]); failures go through an [`error_policy`](Agent::error_policy) that retries
//! with backoff ([`Requeue`]).
//!
//! A `/check` ([`CheckRequest`]) is answered between passes, without a pass; so is a failover
//! probe's result ([`super::probe`]), whose write, if any, comes back as a backend change.
//!
//! Debounce: the first backend or kernel change after a quiet [`DEBOUNCE`](super::DEBOUNCE)
//! starts a pass at once; what follows it within the window coalesces into one more pass. A
//! timer's pass (resync, retry, expiry, check-in) starts at once. When nothing changed, a pass
//! writes nothing.
use std::{future::Future, ops::ControlFlow, pin::Pin, time::Duration};

use backon::{BackoffBuilder as _, ExponentialBackoff, ExponentialBuilder};
use tokio::{
    sync::{mpsc, watch},
    time::{Instant, Interval},
};

use super::{Agent, AgentError, LoopSettings, Planner, Stats};
use crate::{
    backend::Update,
    datapath::DatapathOps,
    reconcile::{Kernel, wireguard::WireGuard},
    telemetry::{CheckRequest, Trigger},
};

/// What the loop does after a pass (kube-rs's `Action`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Action {
    /// Wait for the next trigger.
    AwaitChange,
    /// Also pass again after the next backoff delay.
    Retry,
}

/// When a pass that failed to apply or publish is tried again: after 1 s, doubling up to 30 s,
/// so a failure that cannot be fixed costs a pass every 30 s, never a loop.
#[derive(Debug)]
pub(super) struct Requeue {
    at: Option<Instant>,
    backoff: ExponentialBackoff,
}

impl Default for Requeue {
    fn default() -> Self {
        Requeue {
            at: None,
            backoff: ExponentialBuilder::new()
                .with_min_delay(Duration::from_secs(1))
                .with_max_delay(Duration::from_secs(30))
                .with_factor(2.0)
                .without_max_times()
                .build(),
        }
    }
}

impl Requeue {
    fn after(&mut self, action: Action) {
        match action {
            Action::Retry => self.at = self.backoff.next().map(|d| Instant::now() + d),
            Action::AwaitChange => *self = Requeue::default(),
        }
    }
}

/// When the next pass starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    Wait,
    Now,
    /// After the debounce window, with whatever else arrives within it.
    Debounced,
}

/// What wakes the loop.
struct Triggers<S> {
    updates: watch::Receiver<Update>,
    kernel: Option<mpsc::Receiver<()>>,
    resync: Option<Interval>,
    check_in: Option<Interval>,
    checks: Option<mpsc::Receiver<CheckRequest>>,
    probes: Option<mpsc::Receiver<super::probe::Probed>>,
    shutdown: Pin<Box<S>>,
    /// When the last backend or kernel change that asked for a pass arrived.
    last_change: Option<Instant>,
}

impl<S: Future<Output = ()>> Triggers<S> {
    fn new(
        updates: watch::Receiver<Update>,
        kernel: Option<mpsc::Receiver<()>>,
        checks: Option<mpsc::Receiver<CheckRequest>>,
        probes: Option<mpsc::Receiver<super::probe::Probed>>,
        settings: &LoopSettings,
        shutdown: S,
    ) -> Self {
        let every = |p: Duration| {
            let mut i = tokio::time::interval_at(Instant::now() + p, p);
            i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            i
        };
        Triggers {
            updates,
            kernel,
            resync: settings.resync.map(every),
            check_in: settings.check_in.map(every),
            checks,
            probes,
            shutdown: Box::pin(shutdown),
            last_change: None,
        }
    }
}

impl<P: Planner, K: Kernel, W: WireGuard, D: DatapathOps> Agent<P, K, W, D> {
    /// Runs until `shutdown` completes (or the backend stops), then cleans up when
    /// `--clean-up` is set.
    pub async fn run(
        &mut self,
        kernel_events: Option<mpsc::Receiver<()>>,
        shutdown: impl Future<Output = ()>,
    ) -> Stats {
        let mut t = Triggers::new(
            self.backend.updates(),
            kernel_events,
            self.checks.take(),
            self.probe.as_mut().and_then(|p| p.results.take()),
            &self.settings,
            shutdown,
        );
        // No reconcile before the backend has a complete view: an empty snapshot must never
        // tear the mesh down.
        let mut next = Next::Wait;
        if t.updates.borrow_and_update().generation > 0 {
            self.metrics.trigger(Trigger::Start);
            next = Next::Now;
        }
        loop {
            if next == Next::Debounced && self.debounce(&mut t).await.is_break() {
                break;
            }
            if next != Next::Wait && t.updates.borrow_and_update().generation > 0 {
                let action = match self.turn().await {
                    Ok(action) => action,
                    Err(e) => self.error_policy(&e),
                };
                self.requeue.after(action);
            }
            match self.next_trigger(&mut t).await {
                Some(n) => next = n,
                None => break,
            }
        }
        if self.settings.clean_up {
            if let Err(e) = self.clean_up().await {
                self.metrics.error("cleanUp");
                tracing::error!(error = %e, "clean-up failed");
            }
        } else {
            tracing::info!("--clean-up=false: leaving the mesh and datapath running");
            self.last_check_in().await;
        }
        self.stats.clone()
    }

    /// The loop's turn: one pass, then what next. Something that could not be applied
    /// or published is retried.
    async fn turn(&mut self) -> Result<Action, AgentError> {
        self.publish_failed = false;
        let began = Instant::now();
        let report = self.pass().await?;
        self.failing = None;
        self.healthy = report.problems.is_empty();
        if let Some(start) = self.start_up.filter(|_| report.problems.is_empty()) {
            self.start_up = None;
            tracing::info!(
                target: super::START_UP,
                after_ms = start.elapsed().as_millis() as u64,
                pass_ms = began.elapsed().as_millis() as u64,
                writes = %report.writes,
                "the kernel matches the first plan"
            );
        }
        Ok(if report.problems.is_empty() && !self.publish_failed {
            Action::AwaitChange
        } else {
            Action::Retry
        })
    }

    /// Waits for what starts the next pass; `None` when the loop must stop.
    async fn next_trigger<S: Future<Output = ()>>(&mut self, t: &mut Triggers<S>) -> Option<Next> {
        // The earliest instant a node alive now would expire: re-plan then, not before.
        let now = self.settings.clock.now_ms();
        let expiry = self
            .liveness
            .next_expiry(now)
            .map(|at| Instant::now() + Duration::from_millis((at - now).unsigned_abs()));
        let (pending, cause) = tokio::select! {
            r = t.updates.changed() => {
                if r.is_err() {
                    tracing::error!("backend stopped");
                    return None;
                }
                let update = t.updates.borrow_and_update().clone();
                // A new snapshot is planned; heartbeats alone only when a node revives.
                let pending = update.generation != self.seen_generation
                    || self.liveness_changed(&update);
                (pending, Trigger::Backend)
            }
            Some(()) = recv(&mut t.kernel) => (true, Trigger::Kernel),
            _ = tick(&mut t.resync) => (true, Trigger::Resync),
            _ = sleep_until(self.requeue.at) => {
                self.requeue.at = None;
                (true, Trigger::Retry)
            }
            _ = tick(&mut t.check_in) => (self.check_in().await, Trigger::CheckIn),
            Some(probed) = recv(&mut t.probes) => {
                self.probed(probed).await;
                return Some(Next::Wait);
            }
            Some(reply) = recv(&mut t.checks) => {
                let _ = reply.send(self.check().await);
                return Some(Next::Wait);
            }
            _ = sleep_until(expiry) => {
                let update = t.updates.borrow().clone();
                (self.liveness_changed(&update), Trigger::Liveness)
            }
            _ = &mut t.shutdown => return None,
        };
        if !pending {
            return Some(Next::Wait);
        }
        self.metrics.trigger(cause);
        let now = Instant::now();
        let change = matches!(cause, Trigger::Backend | Trigger::Kernel);
        let burst = change
            && t.last_change
                .is_some_and(|l| now - l < self.settings.debounce);
        if change {
            t.last_change = Some(now);
        }
        Some(if burst { Next::Debounced } else { Next::Now })
    }

    /// Absorbs whatever else arrives within the debounce window; `Break` when the loop must
    /// stop.
    async fn debounce<S: Future<Output = ()>>(&mut self, t: &mut Triggers<S>) -> ControlFlow<()> {
        let window = tokio::time::sleep(self.settings.debounce);
        tokio::pin!(window);
        loop {
            tokio::select! {
                _ = &mut window => return ControlFlow::Continue(()),
                r = t.updates.changed() => {
                    if r.is_err() {
                        return ControlFlow::Break(());
                    }
                    t.updates.borrow_and_update();
                    t.last_change = Some(Instant::now());
                    self.metrics.trigger(Trigger::Backend);
                }
                Some(()) = recv(&mut t.kernel) => {
                    t.last_change = Some(Instant::now());
                    self.metrics.trigger(Trigger::Kernel);
                }
                _ = &mut t.shutdown => return ControlFlow::Break(()),
            }
        }
    }
}

impl<P, K, W, D> Agent<P, K, W, D> {
    /// The error policy: counts and logs a failed pass, and says what next. A planning failure
    /// lasts until the backend changes, which triggers by itself; any other failure (or a
    /// publish that failed with it) is retried with backoff. The same failure again is only a
    /// debug line; the same planning failure is not counted again either.
    fn error_policy(&mut self, e: &AgentError) -> Action {
        let message = e.to_string();
        self.healthy = false;
        let again = self.failing.as_ref() == Some(&message);
        self.failing = Some(message);
        let no_plan = matches!(e, AgentError::NoPlan(_));
        if again && no_plan {
            tracing::debug!(error = %e, "still no plan");
        } else {
            self.metrics.error(e.metric_label());
            if again {
                tracing::debug!(error = %e, "reconcile still failing");
            } else {
                tracing::warn!(error = %e, "reconcile failed");
            }
        }
        if no_plan && !self.publish_failed {
            Action::AwaitChange
        } else {
            Action::Retry
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn recv<T>(rx: &mut Option<mpsc::Receiver<T>>) -> Option<T> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

async fn tick(i: &mut Option<Interval>) {
    match i {
        Some(i) => {
            i.tick().await;
        }
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The delays of the hand-written backoff backon replaced: 1 s doubling up to 30 s, again
    /// from 1 s after a success.
    #[test]
    fn retries_back_off_from_one_second_to_thirty() {
        let mut r = Requeue::default();
        let delays: Vec<u64> = (0..8)
            .map(|_| r.backoff.next().unwrap().as_secs())
            .collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 30, 30, 30]);
        r.after(Action::AwaitChange);
        assert_eq!(r.at, None);
        assert_eq!(r.backoff.next(), Some(Duration::from_secs(1)));
    }
}
