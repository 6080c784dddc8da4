//! The manifest: the index of everything on NVMe (sessions, their metadata, and for every
//! (layer, block) the page holding it), serialized with rkyv and read back through a
//! validated, memory-mapped view.
//!
//! # Files and crash safety
//!
//! Each commit writes a new epoch as two files, `manifest-<epoch>` (20 decimal digits) and its
//! copy `manifest-<epoch>.copy`: each written to `<name>.tmp`, fsync'd and renamed, then the
//! directory is fsync'd. A file is `magic | version | crc32c | epoch | len | reserved` (48
//! bytes) + the rkyv bytes; from version 3 the crc covers the version field, bytes 16..48 and
//! the payload (versions 1 and 2: bytes 16..48 and the payload), so a damaged version field
//! reads as corruption, not as a newer format. Loading takes the newest epoch with a file that
//! verifies (the primary, else its copy) and reports the files it skipped; the previous good
//! epoch is kept until the next commit, so even losing both copies of the newest epoch falls
//! back to it. A commit that fails (a full filesystem) removes its temporary file and never
//! reuses its epoch, so the next commit after space is freed succeeds.
//!
//! If manifest files exist but none verifies, [`ManifestStore::open`] refuses
//! ([`NvmeError::DamagedManifests`]): starting empty would reuse the pages those files
//! describe. [`quarantine`] moves them aside for an operator who chooses to start empty.
//!
//! # Versions
//!
//! Version 2 added [`SessionRecord::pinned`]; version 3 (same layout) puts the version field
//! under the checksum; version 4 (same layout) is for variable-size pages: `page_size` records
//! the store's unit and a page record's `page` is the first unit of its extent (whose length
//! follows from `payload_len`, see [`PageRecord::addr`]), where versions 1 to 3 had fixed
//! pages of `page_size` bytes and `page` counted them. Version 5 adds the policy's selector
//! ([`PolicyRecord::selector`], [`PolicyRecord::candidates`]); sessions of older files come
//! back with the bound selector they were created with. Version 6 adds
//! [`SessionRecord::created_unix_ms`] (0 in older files). Versions 1 to 5 still load (version 1
//! sessions come back unpinned): [`Loaded::recover_into`] converts their fixed pages to units
//! of the store (page `p` becomes unit `p * page_size / unit`, so the data stays where it is
//! and a warm restart after the upgrade keeps its sessions), if the old page size is a whole
//! number of units; the next commit writes version 4. A file that verifies but is of a version
//! this build does not know is [`NvmeError::UnsupportedManifestVersion`] and stops
//! [`ManifestStore::open`], rather than being skipped for an older manifest.
//! The older layouts and their conversions are in `old.rs` ([`v4`], [`v5`], and version 1).
//!
//! # Page reuse rule
//!
//! For that fallback to find its pages intact, pages that epoch E stops referencing may be
//! reused only after epoch E+1 is committed. [`ManifestStore::open`] returns the previous
//! manifest too, so recovery can keep its pages until then ([`Manifest::retired_since`]).

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use rkyv::rancor;

use super::store::{page_units, PageAddr, PageStore};
use super::NvmeError;
use crate::{DType, Geometry, Policy, Selector};

mod file;
mod old;
#[cfg(test)]
use file::*;
pub use file::{load_file, quarantine, ManifestStore};
use old::v1;
pub use old::{v4, v5};

const MAGIC: &[u8; 8] = b"KVTMANI1";
/// The format version commits write.
pub const VERSION: u32 = 6;
/// The first version whose checksum covers the version field.
const VERSION_CHECKSUMMED: u32 = 3;
/// The first version of variable-size pages, addressed in units (before: fixed pages).
pub const VERSION_UNITS: u32 = 4;
/// The oldest format version that still loads.
pub const OLDEST_VERSION: u32 = 1;
const HEADER: usize = 48;
const PREFIX: &str = "manifest-";
/// Suffix of the second copy of each epoch.
const COPY_SUFFIX: &str = ".copy";

/// Model geometry of a session (the fields of the lead's `Geometry`, as plain numbers).
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct GeometryRecord {
    pub layers: u32,
    pub q_heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// 0 = bf16, 1 = fp16, 2 = fp32.
    pub dtype: u8,
    pub block_tokens: u32,
}

/// Selection policy of a session.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct PolicyRecord {
    pub sink_blocks: u32,
    pub local_blocks: u32,
    pub top_k: u32,
    /// `Selector::code`: 0 bound, 1 sketch (version 5; older files: the bound).
    pub selector: u32,
    /// The sketch selector's candidates per kv head (0 for the bound).
    pub candidates: u32,
}

// The manifest's records are the data model's boundary on disk: plain numbers, converted here.

impl From<&Geometry> for GeometryRecord {
    fn from(g: &Geometry) -> Self {
        GeometryRecord {
            layers: g.layers,
            q_heads: g.q_heads,
            kv_heads: g.kv_heads,
            head_dim: g.head_dim,
            dtype: g.dtype.code(),
            block_tokens: g.block_tokens,
        }
    }
}

impl GeometryRecord {
    /// The geometry this record stores; `None` for a dtype code this build does not know.
    pub fn geometry(&self) -> Option<Geometry> {
        Some(Geometry {
            layers: self.layers,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            dtype: DType::from_code(self.dtype)?,
            block_tokens: self.block_tokens,
        })
    }
}

impl From<&Policy> for PolicyRecord {
    fn from(p: &Policy) -> Self {
        PolicyRecord {
            sink_blocks: p.sink_blocks,
            local_blocks: p.local_blocks,
            top_k: p.top_k,
            selector: p.selector.code(),
            candidates: p.selector.candidates(),
        }
    }
}

impl PolicyRecord {
    /// The policy this record stores; `None` for a selector code this build does not know.
    pub fn policy(&self) -> Option<Policy> {
        Some(Policy {
            sink_blocks: self.sink_blocks,
            local_blocks: self.local_blocks,
            top_k: self.top_k,
            selector: Selector::from_code(self.selector, self.candidates)?,
        })
    }
}

/// Where one (layer, block) run of a session lives and what it must verify as.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct PageRecord {
    pub layer: u32,
    pub block: u32,
    pub device: u16,
    /// The first unit of the page's extent (versions 1 to 3: the index of a fixed page).
    pub page: u64,
    pub generation: u64,
    pub crc: u32,
    pub payload_len: u32,
}

impl PageRecord {
    /// The page's address in a store of `unit`-byte units: its extent is exactly the units
    /// that header and payload take (see [`page_units`]).
    pub fn addr(&self, unit: u64) -> PageAddr {
        PageAddr {
            device: self.device,
            page: self.page,
            units: page_units(u64::from(self.payload_len), unit),
        }
    }
}

/// One session on NVMe.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct SessionRecord {
    /// The session's id, kept across restarts.
    pub id: u64,
    /// The uid that created it (SO_PEERCRED), whom its quotas count against.
    pub owner_uid: u32,
    /// The client's label at CREATE_SESSION (may be empty).
    pub label: String,
    /// What the session was created with; a restore makes it again from these.
    pub geometry: GeometryRecord,
    pub policy: PolicyRecord,
    /// Tokens per layer.
    pub layer_tokens: Vec<u64>,
    /// Sorted by (layer, block), one record per run: [`SessionRecord::page`] binary-searches
    /// it. The tier writes it sorted; [`load_file`] sorts a file that is not.
    pub pages: Vec<PageRecord>,
    /// PIN: never demoted; restored as pinned after a restart (version 2).
    pub pinned: bool,
    /// When CREATE_SESSION made the session, ms since the Unix epoch (version 6; older files:
    /// 0, unknown).
    pub created_unix_ms: u64,
}

impl SessionRecord {
    /// The page holding `(layer, block)` (binary search; `pages` is sorted).
    pub fn page(&self, layer: u32, block: u32) -> Option<&PageRecord> {
        self.pages
            .binary_search_by_key(&(layer, block), |p| (p.layer, p.block))
            .ok()
            .map(|i| &self.pages[i])
    }

    fn sort_pages(&mut self) {
        if !self.pages.is_sorted_by_key(|p| (p.layer, p.block)) {
            self.pages.sort_by_key(|p| (p.layer, p.block));
        }
    }
}

/// A backing device as the manifest last saw it.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct DeviceRecord {
    pub path: String,
    /// Units of the device (versions 1 to 3: fixed pages).
    pub pages: u64,
}

/// The whole index, over its sessions' layout: [`Manifest`] is this version's; the older
/// versions ([`v5`], [`v4`], `v1`) differ only in their sessions.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ManifestOf<S> {
    /// Set by [`ManifestStore::commit`].
    pub epoch: u64,
    /// Bytes of the store's unit (versions 1 to 3: of its fixed pages).
    pub page_size: u64,
    pub devices: Vec<DeviceRecord>,
    pub sessions: Vec<S>,
}

/// The manifest of this version.
pub type Manifest = ManifestOf<SessionRecord>;

impl<S> Default for ManifestOf<S> {
    fn default() -> Self {
        Self {
            epoch: 0,
            page_size: 0,
            devices: Vec::new(),
            sessions: Vec::new(),
        }
    }
}

impl<S> ManifestOf<S> {
    /// The same manifest in the next layout (an old file read for an upgrade).
    pub fn upgrade<T: From<S>>(self) -> ManifestOf<T> {
        ManifestOf {
            epoch: self.epoch,
            page_size: self.page_size,
            devices: self.devices,
            sessions: self.sessions.into_iter().map(T::from).collect(),
        }
    }
}

impl Manifest {
    /// An empty manifest describing `store`'s devices.
    pub fn for_store(store: &PageStore) -> Self {
        Self {
            epoch: 0,
            page_size: store.unit() as u64,
            devices: store
                .usage()
                .devices
                .into_iter()
                .map(|d| DeviceRecord {
                    path: d.path.display().to_string(),
                    pages: d.units_total,
                })
                .collect(),
            sessions: Vec::new(),
        }
    }

    pub fn session(&self, id: u64) -> Option<&SessionRecord> {
        self.sessions.iter().find(|s| s.id == id)
    }

    /// Every page the manifest references (extents in units of its `page_size`).
    pub fn page_addrs(&self) -> impl Iterator<Item = PageAddr> + '_ {
        self.sessions
            .iter()
            .flat_map(|s| s.pages.iter().map(|p| p.addr(self.page_size)))
    }

    /// Pages `older` references that `self` does not: free them once the manifest after
    /// `self` is committed.
    pub fn retired_since(&self, older: &Manifest) -> Vec<PageAddr> {
        let now: std::collections::HashSet<PageAddr> = self.page_addrs().collect();
        let mut out: Vec<PageAddr> = older.page_addrs().filter(|a| !now.contains(a)).collect();
        out.sort();
        out.dedup();
        out
    }

    /// Converts a manifest of fixed pages (format versions 1 to 3: `page_size` bytes each,
    /// `page` and the device sizes counting them) to the store's units, in place: page `p`
    /// becomes unit `p * page_size / unit`, so every page stays where it is on the devices.
    /// The old page size must be a whole number of units and the devices the same (each
    /// holds as many whole old pages as the manifest says), else `ManifestMismatch` and
    /// nothing changes.
    pub fn convert_fixed_pages(&mut self, store: &PageStore) -> Result<(), NvmeError> {
        let unit = store.unit() as u64;
        let mismatch = |what: String| Err(NvmeError::ManifestMismatch { what });
        if self.page_size == 0 || !self.page_size.is_multiple_of(unit) {
            return mismatch(format!(
                "manifest epoch {} has fixed pages of {} bytes, not a whole number of the store's {unit}-byte units",
                self.epoch, self.page_size
            ));
        }
        let per_page = self.page_size / unit;
        let units = store.device_units();
        if self.devices.len() != units.len()
            || self
                .devices
                .iter()
                .zip(&units)
                .any(|(d, &u)| d.pages != u / per_page)
        {
            return mismatch(format!(
                "manifest epoch {} describes devices of {:?} pages of {} bytes, store has {:?} units of {unit}",
                self.epoch,
                self.devices.iter().map(|d| d.pages).collect::<Vec<_>>(),
                self.page_size,
                units
            ));
        }
        for s in &self.sessions {
            for p in &s.pages {
                if u64::from(page_units(u64::from(p.payload_len), unit)) > per_page {
                    return mismatch(format!(
                        "manifest epoch {}: session {} (layer {}, block {}) has {} bytes, more than its {}-byte page holds",
                        self.epoch, s.id, p.layer, p.block, p.payload_len, self.page_size
                    ));
                }
                // Against the old page count: the tail of a device past its last whole old
                // page was never a page (and this bounds the multiplication below).
                let dev = self.devices.get(p.device as usize);
                if dev.is_none_or(|d| p.page >= d.pages) {
                    return mismatch(format!(
                        "manifest epoch {}: page {} of device {} (session {}) is outside the devices",
                        self.epoch, p.page, p.device, s.id
                    ));
                }
            }
        }
        for s in &mut self.sessions {
            for p in &mut s.pages {
                p.page *= per_page;
            }
        }
        for (d, &u) in self.devices.iter_mut().zip(&units) {
            d.pages = u;
        }
        self.page_size = unit;
        Ok(())
    }

    /// Checks the manifest against the open store (unit, device count and sizes) and marks
    /// every page it references, and those of `previous` (kept for fallback), as allocated.
    /// Returns the pages to free after the next commit. Both must be in units (format version
    /// 4, or converted: [`Loaded::recover_into`] does both steps).
    pub fn recover_into(
        &self,
        store: &PageStore,
        previous: Option<&Manifest>,
    ) -> Result<Vec<PageAddr>, NvmeError> {
        for m in std::iter::once(self).chain(previous) {
            if m.page_size != store.unit() as u64 {
                return Err(NvmeError::ManifestMismatch {
                    what: format!(
                        "manifest epoch {} has a unit of {} bytes, store {}",
                        m.epoch,
                        m.page_size,
                        store.unit()
                    ),
                });
            }
            let units = store.device_units();
            if m.devices.len() != units.len()
                || m.devices.iter().zip(&units).any(|(d, &u)| d.pages != u)
            {
                return Err(NvmeError::ManifestMismatch {
                    what: format!(
                        "manifest epoch {} describes devices of {:?} units, store has {:?}",
                        m.epoch,
                        m.devices.iter().map(|d| d.pages).collect::<Vec<_>>(),
                        units
                    ),
                });
            }
        }
        for a in self.page_addrs() {
            store.mark_allocated(a)?;
        }
        let retired = previous.map(|p| self.retired_since(p)).unwrap_or_default();
        for &a in &retired {
            store.mark_allocated(a)?;
        }
        Ok(retired)
    }
}

/// What [`ManifestStore::open`] found.
#[derive(Debug)]
pub struct Loaded {
    pub current: Manifest,
    /// The newest valid manifest before `current`, if its file is still there.
    pub previous: Option<Manifest>,
    /// Files that failed verification (newer than `current` or between), with why.
    pub skipped: Vec<(PathBuf, NvmeError)>,
    /// The format `current` is in: the version it was read from, [`VERSION`] once
    /// [`Loaded::recover_into`] has converted it (older than [`VERSION_UNITS`]: fixed pages).
    pub current_version: u32,
    /// The same for `previous` (Some exactly when `previous` is).
    pub previous_version: Option<u32>,
}

impl Loaded {
    /// Recovery at open: converts `current` and `previous` to the store's units where they
    /// are of the fixed-page formats ([`Manifest::convert_fixed_pages`]), then checks them
    /// against the store and marks their pages ([`Manifest::recover_into`]). Returns the pages
    /// to free after the next commit.
    pub fn recover_into(&mut self, store: &PageStore) -> Result<Vec<PageAddr>, NvmeError> {
        if self.current_version < VERSION_UNITS {
            self.current.convert_fixed_pages(store)?;
            self.current_version = VERSION;
        }
        if let (Some(p), Some(v)) = (&mut self.previous, &mut self.previous_version) {
            if *v < VERSION_UNITS {
                p.convert_fixed_pages(store)?;
                *v = VERSION;
            }
        }
        self.current.recover_into(store, self.previous.as_ref())
    }
}

#[cfg(test)]
mod tests;
