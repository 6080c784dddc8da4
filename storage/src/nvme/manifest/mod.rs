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

mod old;
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
    pub id: u64,
    pub owner_uid: u32,
    pub label: String,
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

/// The whole index.
#[derive(
    Debug, Clone, Default, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub struct Manifest {
    /// Set by [`ManifestStore::commit`].
    pub epoch: u64,
    /// Bytes of the store's unit (versions 1 to 3: of its fixed pages).
    pub page_size: u64,
    pub devices: Vec<DeviceRecord>,
    pub sessions: Vec<SessionRecord>,
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

/// The manifest directory.
#[derive(Debug)]
pub struct ManifestStore {
    dir: PathBuf,
    next_epoch: u64,
    /// Epoch of the newest good manifest (kept as the fallback after the next commit).
    last_good: Option<u64>,
}

fn file_name(epoch: u64) -> String {
    format!("{PREFIX}{epoch:020}")
}

fn copy_name(epoch: u64) -> String {
    format!("{}{COPY_SUFFIX}", file_name(epoch))
}

/// The epoch of a manifest file name, primary or copy.
fn parse_epoch(name: &str) -> Option<u64> {
    let name = name.strip_suffix(COPY_SUFFIX).unwrap_or(name);
    let digits = name.strip_prefix(PREFIX)?;
    if digits.len() == 20 && digits.bytes().all(|b| b.is_ascii_digit()) {
        digits.parse().ok()
    } else {
        None
    }
}

impl ManifestStore {
    /// Opens (creating) the directory, removes leftover temporary files, and loads the newest
    /// manifest that verifies. `None` when there is no manifest file at all;
    /// [`NvmeError::DamagedManifests`] when there are some but none verifies.
    pub fn open(dir: &Path) -> Result<(Self, Option<Loaded>), NvmeError> {
        fs::create_dir_all(dir).map_err(|e| NvmeError::os("mkdir", dir, e))?;
        let mut epochs = Vec::new();
        let mut files = 0;
        for entry in fs::read_dir(dir).map_err(|e| NvmeError::os("readdir", dir, e))? {
            let entry = entry.map_err(|e| NvmeError::os("readdir", dir, e))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if name.starts_with(PREFIX) && name.ends_with(".tmp") {
                // An interrupted commit: never renamed, so never acknowledged.
                let p = entry.path();
                fs::remove_file(&p).map_err(|e| NvmeError::os("unlink", &p, e))?;
            } else if let Some(e) = parse_epoch(name) {
                files += 1;
                epochs.push(e);
            }
        }
        epochs.sort_unstable_by(|a, b| b.cmp(a));
        epochs.dedup();
        let next_epoch = epochs.first().map_or(1, |e| e + 1);
        let mut skipped = Vec::new();
        let mut good: Vec<(Manifest, u32)> = Vec::new();
        for &e in &epochs {
            // The primary, else its copy: one damaged file loses nothing.
            for path in [dir.join(file_name(e)), dir.join(copy_name(e))] {
                if !path.exists() {
                    continue;
                }
                match load_versioned(&path) {
                    Ok((m, version)) if m.epoch == e => {
                        good.push((m, version));
                        break;
                    }
                    Ok((m, _)) => skipped.push((
                        path.clone(),
                        NvmeError::CorruptManifest {
                            path,
                            reason: format!("file name says epoch {e}, contents {}", m.epoch),
                        },
                    )),
                    Err(err @ NvmeError::UnsupportedManifestVersion { .. }) if good.is_empty() => {
                        return Err(err);
                    }
                    Err(err) => {
                        if good.is_empty() {
                            tracing::warn!(path = %path.display(), error = %err, "skipping bad manifest");
                        }
                        skipped.push((path, err));
                    }
                }
            }
            if good.len() == 2 {
                break;
            }
        }
        if good.is_empty() && files > 0 {
            return Err(NvmeError::DamagedManifests {
                dir: dir.to_path_buf(),
                files,
            });
        }
        let mut good = good.into_iter();
        let loaded = good.next().map(|(current, current_version)| {
            let (previous, previous_version) = good.next().unzip();
            Loaded {
                current,
                previous,
                skipped,
                current_version,
                previous_version,
            }
        });
        let store = Self {
            dir: dir.to_path_buf(),
            next_epoch,
            last_good: loaded.as_ref().map(|l| l.current.epoch),
        };
        Ok((store, loaded))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The epoch the next commit will get.
    pub fn next_epoch(&self) -> u64 {
        self.next_epoch
    }

    /// Durably replaces the manifest: when this returns `Ok(epoch)`, a restart loads this
    /// manifest (from either of its two files; or, if both are later damaged, the previous
    /// one). Sets `m.epoch`. On error nothing is left behind but the used-up epoch number.
    pub fn commit(&mut self, m: &mut Manifest) -> Result<u64, NvmeError> {
        let epoch = self.next_epoch;
        // Used up even if the commit fails, so a retry never meets a name of this one.
        self.next_epoch += 1;
        m.epoch = epoch;
        let payload = rkyv::to_bytes::<rancor::Error>(m)
            .map_err(|e| NvmeError::invalid(format!("manifest does not serialize: {e}")))?;
        let written = [file_name(epoch), copy_name(epoch)]
            .iter()
            .try_for_each(|name| self.write_renamed(name, epoch, &payload))
            .and_then(|()| {
                File::open(&self.dir)
                    .and_then(|d| d.sync_all())
                    .map_err(|e| map_os("fsync(dir)", &self.dir, e))
            });
        if let Err(e) = written {
            // Not acknowledged: a primary that made it would be a newer epoch than the one
            // the caller keeps serving, so it goes too.
            for name in [file_name(epoch), copy_name(epoch)] {
                let _ = fs::remove_file(self.dir.join(name));
            }
            return Err(e);
        }
        // Keep the previous good manifest as the fallback; everything older goes.
        let keep_from = self.last_good.unwrap_or(epoch);
        self.last_good = Some(epoch);
        self.remove_older_than(keep_from);
        Ok(epoch)
    }

    /// Writes one file of an epoch through `<name>.tmp` and a rename; removes the temporary
    /// file on failure.
    fn write_renamed(&self, name: &str, epoch: u64, payload: &[u8]) -> Result<(), NvmeError> {
        let tmp = self.dir.join(format!("{name}.tmp"));
        let r = write_file(&tmp, VERSION, epoch, payload).and_then(|()| {
            fs::rename(&tmp, self.dir.join(name)).map_err(|e| map_os("rename", &tmp, e))
        });
        if r.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        r
    }

    fn remove_older_than(&self, epoch: u64) {
        let Ok(rd) = fs::read_dir(&self.dir) else {
            return;
        };
        for entry in rd.flatten() {
            let name = entry.file_name();
            if let Some(e) = name.to_str().and_then(parse_epoch) {
                if e < epoch {
                    if let Err(err) = fs::remove_file(entry.path()) {
                        tracing::warn!(error = %err, "could not remove old manifest");
                    }
                }
            }
        }
    }
}

/// Writes header + payload to a new file `path` and fsyncs it.
fn write_file(path: &Path, version: u32, epoch: u64, payload: &[u8]) -> Result<(), NvmeError> {
    let mut header = [0u8; HEADER];
    header[0..8].copy_from_slice(MAGIC);
    header[8..12].copy_from_slice(&version.to_le_bytes());
    header[16..24].copy_from_slice(&epoch.to_le_bytes());
    header[24..32].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    let crc = checksum(version, &header, payload);
    header[12..16].copy_from_slice(&crc.to_le_bytes());
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| map_os("create", path, e))?;
    f.write_all(&header)
        .and_then(|_| f.write_all(payload))
        .map_err(|e| map_os("write", path, e))?;
    f.sync_all().map_err(|e| map_os("fsync", path, e))
}

/// The crc32c of a file of format `version` (`header` as stored; its crc field is not read).
fn checksum(version: u32, header: &[u8], payload: &[u8]) -> u32 {
    let head = if version >= VERSION_CHECKSUMMED {
        crc32c::crc32c_append(crc32c::crc32c(&header[8..12]), &header[16..HEADER])
    } else {
        crc32c::crc32c(&header[16..HEADER])
    };
    crc32c::crc32c_append(head, payload)
}

/// An OS error of a manifest file operation; ENOSPC (also from create, fsync or rename on a
/// full filesystem) is [`NvmeError::NoSpace`], which the daemon answers RESOURCE_EXHAUSTED.
fn map_os(op: &'static str, path: &Path, e: std::io::Error) -> NvmeError {
    if e.raw_os_error() == Some(libc::ENOSPC) {
        NvmeError::NoSpace { offset: 0, len: 0 }
    } else {
        NvmeError::os(op, path, e)
    }
}

/// Moves every manifest file of `dir` and the given page files into a new directory
/// `dir/quarantine-<unix ms>` (returned), so a tier can start empty without reusing the pages
/// the damaged manifests describe. Page files must be regular files on the same filesystem
/// (a rename); anything else is refused before anything moves.
pub fn quarantine(dir: &Path, page_files: &[PathBuf]) -> Result<PathBuf, NvmeError> {
    use std::os::unix::fs::FileTypeExt;
    for p in page_files {
        match fs::metadata(p) {
            Ok(md) if md.file_type().is_block_device() => {
                return Err(NvmeError::invalid(format!(
                    "{} is a block device: it cannot be moved aside; recover or wipe it by hand",
                    p.display()
                )))
            }
            _ => {}
        }
    }
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let q = dir.join(format!("quarantine-{ms}"));
    fs::create_dir(&q).map_err(|e| NvmeError::os("mkdir", &q, e))?;
    let mut moving: Vec<PathBuf> = page_files.iter().filter(|p| p.exists()).cloned().collect();
    for entry in fs::read_dir(dir).map_err(|e| NvmeError::os("readdir", dir, e))? {
        let entry = entry.map_err(|e| NvmeError::os("readdir", dir, e))?;
        if entry.file_name().to_str().and_then(parse_epoch).is_some() {
            moving.push(entry.path());
        }
    }
    for (i, p) in moving.iter().enumerate() {
        let name = p
            .file_name()
            .map_or_else(|| format!("file-{i}").into(), |n| n.to_owned());
        let to = q.join(name);
        fs::rename(p, &to).map_err(|e| NvmeError::os("rename", p, e))?;
    }
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| NvmeError::os("fsync(dir)", dir, e))?;
    Ok(q)
}

/// Reads and fully verifies one manifest file (header, length, crc32c, rkyv validation). A
/// file of format version 1 to 3 comes back as stored, in fixed pages (see
/// [`Manifest::convert_fixed_pages`]).
pub fn load_file(path: &Path) -> Result<Manifest, NvmeError> {
    load_versioned(path).map(|(m, _)| m)
}

/// [`load_file`], with the file's format version.
fn load_versioned(path: &Path) -> Result<(Manifest, u32), NvmeError> {
    let corrupt = |reason: String| NvmeError::CorruptManifest {
        path: path.to_path_buf(),
        reason,
    };
    let file = File::open(path).map_err(|e| NvmeError::os("open", path, e))?;
    let size = file
        .metadata()
        .map_err(|e| NvmeError::os("fstat", path, e))?
        .len();
    if size < HEADER as u64 {
        return Err(corrupt(format!(
            "truncated: {size} bytes, header is {HEADER}"
        )));
    }
    // SAFETY: committed manifest files are never modified in place (new epochs are new files
    // made by rename), so the mapping does not change under us.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| NvmeError::os("mmap", path, e))?;
    if &map[0..8] != MAGIC {
        return Err(corrupt("bad magic".into()));
    }
    let version = u32::from_le_bytes(map[8..12].try_into().expect("4 bytes"));
    let stored = u32::from_le_bytes(map[12..16].try_into().expect("4 bytes"));
    let epoch = u64::from_le_bytes(map[16..24].try_into().expect("8 bytes"));
    let len = u64::from_le_bytes(map[24..32].try_into().expect("8 bytes"));
    if HEADER as u64 + len != size {
        return Err(corrupt(format!(
            "length {len} + header does not match file size {size} (truncated or padded)"
        )));
    }
    // Versions 1 and 2 keep the version out of the checksum; later ones cover it, so a file
    // that verifies under neither rule is corrupt, and one of an unknown version that
    // verifies is a newer format.
    let computed = checksum(version, &map[..HEADER], &map[HEADER..]);
    if stored != computed {
        return Err(corrupt(format!(
            "crc32c stored {stored:#010x}, computed {computed:#010x}"
        )));
    }
    // The mapping is page aligned and the header is 48 bytes, so the payload is 16-aligned.
    let body = &map[HEADER..];
    let mut m: Manifest = match version {
        VERSION => {
            let archived = rkyv::access::<ArchivedManifest, rancor::Error>(body)
                .map_err(|e| corrupt(format!("rkyv validation: {e}")))?;
            rkyv::deserialize::<Manifest, rancor::Error>(archived)
                .map_err(|e| corrupt(format!("rkyv deserialize: {e}")))?
        }
        5 => {
            let archived = rkyv::access::<v5::ArchivedManifest, rancor::Error>(body)
                .map_err(|e| corrupt(format!("rkyv validation (version 5): {e}")))?;
            rkyv::deserialize::<v5::Manifest, rancor::Error>(archived)
                .map_err(|e| corrupt(format!("rkyv deserialize (version 5): {e}")))?
                .into()
        }
        // The same layout: 3 moved the version under the checksum, 4 changed what
        // `page_size` and `page` count.
        2..=4 => {
            let archived = rkyv::access::<v4::ArchivedManifest, rancor::Error>(body)
                .map_err(|e| corrupt(format!("rkyv validation (version {version}): {e}")))?;
            let m: v5::Manifest = rkyv::deserialize::<v4::Manifest, rancor::Error>(archived)
                .map_err(|e| corrupt(format!("rkyv deserialize (version {version}): {e}")))?
                .into();
            m.into()
        }
        1 => {
            let archived = rkyv::access::<v1::ArchivedManifest, rancor::Error>(body)
                .map_err(|e| corrupt(format!("rkyv validation (version 1): {e}")))?;
            let m: v4::Manifest = rkyv::deserialize::<v1::Manifest, rancor::Error>(archived)
                .map_err(|e| corrupt(format!("rkyv deserialize (version 1): {e}")))?
                .into();
            let m: v5::Manifest = m.into();
            m.into()
        }
        found => {
            return Err(NvmeError::UnsupportedManifestVersion {
                path: path.to_path_buf(),
                found,
                oldest: OLDEST_VERSION,
                newest: VERSION,
            })
        }
    };
    if m.epoch != epoch {
        return Err(corrupt(format!(
            "header epoch {epoch}, body epoch {}",
            m.epoch
        )));
    }
    // Lookups binary-search the page records; every tierd writes them sorted, but the file
    // format does not promise it.
    for s in &mut m.sessions {
        s.sort_pages();
    }
    Ok((m, version))
}

#[cfg(test)]
mod tests;
