//! FakeKernel: links, addresses, routes and rules in memory, for fast tests.
use super::{
    Kernel, KernelError,
    state::{KRoute, KernelDiff, KernelState, LinkState},
};
use crate::{
    plan::Devices,
    writes::{Write, Writes},
};

/// An in-memory kernel: links, addresses, our routes and rules, with write counting.
#[derive(Debug, Default)]
pub struct FakeKernel {
    pub state: KernelState,
    pub next_index: u32,
    /// Drops the realm of the routes it adds, like a kernel without CONFIG_IP_ROUTE_CLASSID.
    pub drops_realms: bool,
}

impl Kernel for FakeKernel {
    async fn observe(&mut self, devices: &Devices) -> Result<KernelState, KernelError> {
        let mut s = self.state.clone();
        let names: Vec<&str> = devices.names().collect();
        s.links.retain(|n, _| names.contains(&n.as_str()));
        Ok(s)
    }

    async fn create_wireguard(&mut self, name: &str) -> Result<Writes, KernelError> {
        self.next_index = self.next_index.max(100) + 1;
        self.state.links.insert(
            name.into(),
            LinkState {
                index: self.next_index,
                up: false,
                mtu: 1420,
            },
        );
        let mut w = Writes::default();
        w.add(Write::LinkAdd, 1);
        Ok(w)
    }

    async fn delete_link(&mut self, index: u32) -> Result<Writes, KernelError> {
        self.state.links.retain(|_, l| l.index != index);
        self.state.addresses.clear();
        self.state.routes.retain(|r| r.oif != index);
        let mut w = Writes::default();
        w.add(Write::LinkDel, 1);
        Ok(w)
    }

    async fn apply(&mut self, d: &KernelDiff) -> (Writes, Vec<KernelError>) {
        let mut w = Writes::default();
        if let Some((up, mtu)) = d.link_set {
            if let Some(l) = self
                .state
                .links
                .values_mut()
                .find(|l| l.index == d.link_index)
            {
                l.up |= up;
                if let Some(m) = mtu {
                    l.mtu = m;
                }
            }
            w.add(Write::LinkSet, 1);
        }
        for a in &d.address_add {
            self.state.addresses.insert(*a);
        }
        w.add(Write::AddressAdd, d.address_add.len() as u64);
        for (r, replace) in &d.route_add {
            if *replace {
                self.state
                    .routes
                    .retain(|o| !(o.table == r.table && o.dst == r.dst));
            }
            let realm = r.realm.filter(|_| !self.drops_realms);
            self.state.routes.insert(KRoute { realm, ..r.clone() });
            w.add(
                if *replace {
                    Write::RouteReplace
                } else {
                    Write::RouteAdd
                },
                1,
            );
        }
        for r in &d.rule_add {
            self.state.rules.insert(r.clone(), Some(32000));
        }
        w.add(Write::RuleAdd, d.rule_add.len() as u64);
        for (r, _) in &d.rule_del {
            self.state.rules.remove(r);
        }
        w.add(Write::RuleDel, d.rule_del.len() as u64);
        for r in &d.route_del {
            self.state.routes.remove(r);
        }
        w.add(Write::RouteDel, d.route_del.len() as u64);
        for a in &d.address_del {
            self.state.addresses.remove(a);
        }
        w.add(Write::AddressDel, d.address_del.len() as u64);
        (w, Vec::new())
    }
}
