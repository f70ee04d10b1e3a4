//! [`ShapeFault`]: why the demo's sides cannot be built with the sizes, layout or model given.

/// Why the demo's sides cannot be built with these sizes, layout or model
/// ([`super::WorldError::Shape`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeFault {
    /// TP or PP is 0, or PP is above the layer count.
    #[error("TP {tp} / PP {pp}: both must be at least 1 and PP at most the layer count {layers}")]
    Parallelism {
        /// TP size.
        tp: u32,
        /// PP size.
        pp: u32,
        /// The model's layers (attention and state).
        layers: u32,
    },
    /// More KV heads than TP ranks, not a multiple of TP.
    #[error("TP {tp}: {heads} KV heads do not split evenly")]
    HeadsSplit {
        /// TP size.
        tp: u32,
        /// The model's KV heads.
        heads: u32,
    },
    /// More TP ranks than KV heads, not a multiple of them.
    #[error("TP {tp}: not a multiple of the {heads} KV heads")]
    NotHeadMultiple {
        /// TP size.
        tp: u32,
        /// The model's KV heads.
        heads: u32,
    },
    /// A layout with a KV dimension for an MLA model, or without one for another.
    #[error("layout {layout:?}: {model} needs {}", if *.mla { "no KV dimension" } else { "a KV dimension" })]
    KvDim {
        /// The layout text.
        layout: String,
        /// The model's name.
        model: &'static str,
        /// Whether the model is MLA (one latent, no K and V).
        mla: bool,
    },
    /// A layout without H although each rank holds more than one head.
    #[error("layout {layout:?} has no H dimension but each rank holds {heads_per_rank} heads")]
    NoHeadDim {
        /// The layout text.
        layout: String,
        /// Heads per rank.
        heads_per_rank: u64,
    },
    /// A layout whose innermost dimension is not D.
    #[error(
        "layout {0:?}: the demo's KV generator needs D innermost (as every vLLM layout has); \
         other layouts are covered by `kvferry checksum --spec` and the checksum tests"
    )]
    DNotInnermost(String),
    /// State bytes that do not split into the KV heads in whole elements.
    #[error(
        "{model}: {state_bytes} state bytes do not split into {heads} heads of whole elements"
    )]
    StateSplit {
        /// The model's name.
        model: &'static str,
        /// State bytes per layer.
        state_bytes: u64,
        /// The model's KV heads.
        heads: u32,
    },
}
