//! The layouts of older manifest versions, read only to upgrade old files (and written by
//! tests that make such files), each converted to the next: version 1 to 4, 4 to 5, 5 to the
//! current one.

/// The layout of version 5 (no creation time), read only to upgrade old files (and written by
/// tests that make such files).
pub mod v5 {
    use crate::nvme::manifest::{DeviceRecord, GeometryRecord, PageRecord, PolicyRecord};

    #[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
    pub struct SessionRecord {
        pub id: u64,
        pub owner_uid: u32,
        pub label: String,
        pub geometry: GeometryRecord,
        pub policy: PolicyRecord,
        pub layer_tokens: Vec<u64>,
        pub pages: Vec<PageRecord>,
        pub pinned: bool,
    }

    #[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
    pub struct Manifest {
        pub epoch: u64,
        pub page_size: u64,
        pub devices: Vec<DeviceRecord>,
        pub sessions: Vec<SessionRecord>,
    }

    impl From<Manifest> for crate::nvme::manifest::Manifest {
        /// The creation time of these sessions is unknown (0).
        fn from(m: Manifest) -> Self {
            Self {
                epoch: m.epoch,
                page_size: m.page_size,
                devices: m.devices,
                sessions: m
                    .sessions
                    .into_iter()
                    .map(|s| crate::nvme::manifest::SessionRecord {
                        id: s.id,
                        owner_uid: s.owner_uid,
                        label: s.label,
                        geometry: s.geometry,
                        policy: s.policy,
                        layer_tokens: s.layer_tokens,
                        pages: s.pages,
                        pinned: s.pinned,
                        created_unix_ms: 0,
                    })
                    .collect(),
            }
        }
    }
}

/// The layout of versions 2 to 4 (a policy without its selector), read only to upgrade old
/// files (and written by tests that make such files).
pub mod v4 {
    use crate::nvme::manifest::{DeviceRecord, GeometryRecord, PageRecord};

    #[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
    pub struct PolicyRecord {
        pub sink_blocks: u32,
        pub local_blocks: u32,
        pub top_k: u32,
    }

    #[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
    pub struct SessionRecord {
        pub id: u64,
        pub owner_uid: u32,
        pub label: String,
        pub geometry: GeometryRecord,
        pub policy: PolicyRecord,
        pub layer_tokens: Vec<u64>,
        pub pages: Vec<PageRecord>,
        pub pinned: bool,
    }

    #[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
    pub struct Manifest {
        pub epoch: u64,
        pub page_size: u64,
        pub devices: Vec<DeviceRecord>,
        pub sessions: Vec<SessionRecord>,
    }

    impl From<Manifest> for super::v5::Manifest {
        /// Sessions of these versions were created with the bound selector.
        fn from(m: Manifest) -> Self {
            Self {
                epoch: m.epoch,
                page_size: m.page_size,
                devices: m.devices,
                sessions: m
                    .sessions
                    .into_iter()
                    .map(|s| super::v5::SessionRecord {
                        id: s.id,
                        owner_uid: s.owner_uid,
                        label: s.label,
                        geometry: s.geometry,
                        policy: crate::nvme::manifest::PolicyRecord {
                            sink_blocks: s.policy.sink_blocks,
                            local_blocks: s.policy.local_blocks,
                            top_k: s.policy.top_k,
                            selector: crate::Selector::Bound.code(),
                            candidates: 0,
                        },
                        layer_tokens: s.layer_tokens,
                        pages: s.pages,
                        pinned: s.pinned,
                    })
                    .collect(),
            }
        }
    }
}

/// The version 1 layout (no `pinned`), read only to upgrade old files.
pub(super) mod v1 {
    use super::v4::PolicyRecord;
    use crate::nvme::manifest::{DeviceRecord, GeometryRecord, PageRecord};

    #[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
    pub struct SessionRecord {
        pub id: u64,
        pub owner_uid: u32,
        pub label: String,
        pub geometry: GeometryRecord,
        pub policy: PolicyRecord,
        pub layer_tokens: Vec<u64>,
        pub pages: Vec<PageRecord>,
    }

    #[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
    pub struct Manifest {
        pub epoch: u64,
        pub page_size: u64,
        pub devices: Vec<DeviceRecord>,
        pub sessions: Vec<SessionRecord>,
    }

    impl From<Manifest> for super::v4::Manifest {
        fn from(m: Manifest) -> Self {
            Self {
                epoch: m.epoch,
                page_size: m.page_size,
                devices: m.devices,
                sessions: m
                    .sessions
                    .into_iter()
                    .map(|s| super::v4::SessionRecord {
                        id: s.id,
                        owner_uid: s.owner_uid,
                        label: s.label,
                        geometry: s.geometry,
                        policy: s.policy,
                        layer_tokens: s.layer_tokens,
                        pages: s.pages,
                        pinned: false,
                    })
                    .collect(),
            }
        }
    }
}
