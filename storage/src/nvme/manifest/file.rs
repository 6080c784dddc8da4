//! The manifest files: one per epoch, written beside and renamed into place, checksummed,
//! loaded newest first with the previous one as the fallback, and set aside (quarantine) when
//! damaged.

use super::*;

/// The manifest directory.
#[derive(Debug)]
pub struct ManifestStore {
    dir: PathBuf,
    next_epoch: u64,
    /// Epoch of the newest good manifest (kept as the fallback after the next commit).
    last_good: Option<u64>,
}

pub(super) fn file_name(epoch: u64) -> String {
    format!("{PREFIX}{epoch:020}")
}

pub(super) fn copy_name(epoch: u64) -> String {
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
pub(super) fn write_file(
    path: &Path,
    version: u32,
    epoch: u64,
    payload: &[u8],
) -> Result<(), NvmeError> {
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
    let m: Result<Manifest, String> = match version {
        VERSION => decode::<Manifest>(body, version),
        5 => decode::<v5::Manifest>(body, version).map(ManifestOf::upgrade),
        // The same layout: 3 moved the version under the checksum, 4 changed what
        // `page_size` and `page` count.
        2..=4 => decode::<v4::Manifest>(body, version)
            .map(|m| m.upgrade::<v5::SessionRecord>().upgrade()),
        1 => decode::<v1::Manifest>(body, version).map(|m| {
            m.upgrade::<v4::SessionRecord>()
                .upgrade::<v5::SessionRecord>()
                .upgrade()
        }),
        found => {
            return Err(NvmeError::UnsupportedManifestVersion {
                path: path.to_path_buf(),
                found,
                oldest: OLDEST_VERSION,
                newest: VERSION,
            })
        }
    };
    let mut m = m.map_err(corrupt)?;
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

/// Validates and deserializes a manifest body of `version`'s layout `T`; the message of a
/// body that does not validate.
fn decode<T>(body: &[u8], version: u32) -> Result<T, String>
where
    T: rkyv::Archive,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rancor::Error>>
        + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rancor::Error>>,
{
    let archived = rkyv::access::<T::Archived, rancor::Error>(body)
        .map_err(|e| format!("rkyv validation (version {version}): {e}"))?;
    rkyv::deserialize::<T, rancor::Error>(archived)
        .map_err(|e| format!("rkyv deserialize (version {version}): {e}"))
}
