//! Who may hold the daemon's connection slots (`server.max_connections`,
//! `server.admin_connections`, `server.max_connections_per_uid`).

use std::collections::HashMap;
use std::sync::Arc;

use super::ServerSettings;
use crate::error::{ServiceError, ServiceResult};

/// The connection slots: `server.max_connections` in all, of which the last
/// `server.admin_connections` only admins may take, and at most
/// `server.max_connections_per_uid` for one non-admin uid. So no local user can hold every
/// slot, and an operator can always connect.
pub(super) struct ConnectionSlots {
    max: usize,
    admin_reserved: usize,
    per_uid: usize,
    /// Open connections in all, and per uid.
    held: parking_lot::Mutex<(usize, HashMap<u32, usize>)>,
}

/// One accepted connection's slot, given back when dropped.
pub(super) struct ConnectionSlot {
    slots: Arc<ConnectionSlots>,
    uid: u32,
}

impl ConnectionSlots {
    pub(super) fn new(s: &ServerSettings) -> Self {
        ConnectionSlots {
            max: s.max_connections,
            admin_reserved: s.admin_connections,
            per_uid: s.max_connections_per_uid,
            held: parking_lot::Mutex::new((0, HashMap::new())),
        }
    }

    /// A slot for a connection of `uid`, or the RESOURCE_EXHAUSTED that refuses it.
    pub(super) fn take(self: &Arc<Self>, uid: u32, admin: bool) -> ServiceResult<ConnectionSlot> {
        let mut held = self.held.lock();
        let (total, per_uid) = &mut *held;
        let mine = per_uid.get(&uid).copied().unwrap_or(0);
        if admin {
            if *total >= self.max {
                return Err(ServiceError::exhausted(format!(
                    "too many connections ({}; server.max_connections)",
                    self.max
                )));
            }
        } else if *total >= self.max - self.admin_reserved {
            return Err(ServiceError::exhausted(format!(
                "too many connections ({} open; server.max_connections {} less \
                 server.admin_connections {} kept for admins)",
                *total, self.max, self.admin_reserved
            )));
        } else if self.per_uid > 0 && mine >= self.per_uid {
            return Err(ServiceError::exhausted(format!(
                "uid {uid} holds {mine} connections (server.max_connections_per_uid)"
            )));
        }
        *total += 1;
        per_uid.insert(uid, mine + 1);
        Ok(ConnectionSlot {
            slots: self.clone(),
            uid,
        })
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut held = self.slots.held.lock();
        let (total, per_uid) = &mut *held;
        *total -= 1;
        if let Some(n) = per_uid.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                per_uid.remove(&self.uid);
            }
        }
    }
}
