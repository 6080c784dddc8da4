//! The layouts of older manifest versions, read only to upgrade old files (and written by
//! tests that make such files): their sessions ([`ManifestOf`] is the rest), each converted
//! to the next: version 1 to 4, 4 to 5, 5 to the current one.

/// The layout of version 5 (no creation time).
pub mod v5 {
    use crate::nvme::manifest::{GeometryRecord, ManifestOf, PageRecord, PolicyRecord};

    /// A session of versions 2 to 5, over its policy's layout (version 5's [`PolicyRecord`],
    /// or [`super::v4::PolicyRecord`] before the selector).
    #[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
    pub struct SessionRecordOf<P> {
        pub id: u64,
        pub owner_uid: u32,
        pub label: String,
        pub geometry: GeometryRecord,
        pub policy: P,
        pub layer_tokens: Vec<u64>,
        pub pages: Vec<PageRecord>,
        pub pinned: bool,
    }

    pub type SessionRecord = SessionRecordOf<PolicyRecord>;
    pub type Manifest = ManifestOf<SessionRecord>;

    impl<P> SessionRecordOf<P> {
        /// The same session with its policy converted by `f`.
        fn map_policy<Q>(self, f: impl FnOnce(P) -> Q) -> SessionRecordOf<Q> {
            SessionRecordOf {
                id: self.id,
                owner_uid: self.owner_uid,
                label: self.label,
                geometry: self.geometry,
                policy: f(self.policy),
                layer_tokens: self.layer_tokens,
                pages: self.pages,
                pinned: self.pinned,
            }
        }
    }

    impl From<SessionRecord> for crate::nvme::manifest::SessionRecord {
        /// The creation time of these sessions is unknown (0).
        fn from(s: SessionRecord) -> Self {
            Self {
                id: s.id,
                owner_uid: s.owner_uid,
                label: s.label,
                geometry: s.geometry,
                policy: s.policy,
                layer_tokens: s.layer_tokens,
                pages: s.pages,
                pinned: s.pinned,
                created_unix_ms: 0,
            }
        }
    }

    impl From<super::v4::SessionRecord> for SessionRecord {
        /// Sessions of versions 2 to 4 were created with the bound selector.
        fn from(s: super::v4::SessionRecord) -> Self {
            s.map_policy(|p| PolicyRecord {
                sink_blocks: p.sink_blocks,
                local_blocks: p.local_blocks,
                top_k: p.top_k,
                selector: crate::Selector::Bound.code(),
                candidates: 0,
            })
        }
    }
}

/// The layout of versions 2 to 4 (a policy without its selector).
pub mod v4 {
    use crate::nvme::manifest::ManifestOf;

    #[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
    pub struct PolicyRecord {
        pub sink_blocks: u32,
        pub local_blocks: u32,
        pub top_k: u32,
    }

    pub type SessionRecord = super::v5::SessionRecordOf<PolicyRecord>;
    pub type Manifest = ManifestOf<SessionRecord>;
}

/// The version 1 layout (no `pinned`).
pub(super) mod v1 {
    use super::v4::PolicyRecord;
    use crate::nvme::manifest::{GeometryRecord, ManifestOf, PageRecord};

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

    pub type Manifest = ManifestOf<SessionRecord>;

    impl From<SessionRecord> for super::v4::SessionRecord {
        fn from(s: SessionRecord) -> Self {
            Self {
                id: s.id,
                owner_uid: s.owner_uid,
                label: s.label,
                geometry: s.geometry,
                policy: s.policy,
                layer_tokens: s.layer_tokens,
                pages: s.pages,
                pinned: false,
            }
        }
    }
}
