//! Model shapes for the demo and the benchmark: the KV cache geometry of real
//! models (layer count, KV heads, head size, dtype), split over TP/PP ranks.
//!
//! Sources: the models' published configs (Qwen3-0.6B: 28 layers, 8 KV heads,
//! head_dim 128; Llama-3-8B: 32 layers, 8 KV heads, head_dim 128;
//! DeepSeek-V2-Lite: 27 layers, MLA latent cache kv_lora_rank 512 + rope 64),
//! docs/design.md §2.2 (layouts) and §2.3 (replicas).

use std::fmt;

/// The shape of one model's KV cache (the unsharded model).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelShape {
    /// Short name used on the command line (`--model`).
    pub name: &'static str,
    /// Number of attention layers, each with one KV cache.
    pub layers: u32,
    /// KV heads per layer (1 for MLA: one latent "head").
    pub kv_heads: u32,
    /// Elements per head and part (head_dim, or the MLA latent width).
    pub head_dim: u64,
    /// Bytes per element (2 for bf16).
    pub elem_bytes: u64,
    /// `torch` dtype name, used in fingerprints.
    pub dtype: &'static str,
    /// True for MLA: one part (no separate K and V), held whole by every TP rank.
    pub mla: bool,
    /// Sliding-window attention layers (as Gemma 3, gpt-oss): `Some((period, window))` makes
    /// every attention layer `i` with `i % period != period - 1` a sliding-window layer of
    /// `window` tokens (KV cache group 1); the others stay full attention (group 0).
    pub sliding: Option<(u32, u64)>,
    /// Mamba-type state layers after the attention layers (KV cache group 2): each holds one
    /// state of `state_bytes` per block, its heads split over TP as the KV heads, no per-token
    /// blocks (moved, not checksummed).
    pub state_layers: u32,
    /// Bytes of one state layer's state per block (unsharded model).
    pub state_bytes: u64,
}

impl ModelShape {
    /// KV bytes per token over the whole model: layers × heads × parts × head_dim × elem.
    pub fn bytes_per_token(&self) -> u64 {
        let parts = if self.mla { 1 } else { 2 };
        self.layers as u64 * self.kv_heads as u64 * parts * self.head_dim * self.elem_bytes
    }

    /// vLLM's KV cache spec class name for this model's layers of group `group`.
    pub fn kind(&self, group: u32) -> &'static str {
        match group {
            _ if self.mla => "MLAAttentionSpec",
            SLIDING_GROUP => "SlidingWindowSpec",
            STATE_GROUP => "MambaSpec",
            _ => "FullAttentionSpec",
        }
    }

    /// The layer module name vLLM gives layer `i` (attention, then state layers).
    pub fn layer_name(&self, i: u32) -> String {
        if i >= self.layers {
            format!("model.layers.{i}.mixer")
        } else {
            format!("model.layers.{i}.self_attn.attn")
        }
    }

    /// The KV cache group of layer `i` (attention layers `0..layers`, then state layers):
    /// [`FULL_GROUP`], [`SLIDING_GROUP`] or [`STATE_GROUP`].
    pub fn group_of(&self, i: u32) -> u32 {
        match self.sliding {
            _ if i >= self.layers => STATE_GROUP,
            Some((period, _)) if i % period != period - 1 => SLIDING_GROUP,
            _ => FULL_GROUP,
        }
    }

    /// The KV cache groups the model has, ascending.
    pub fn groups(&self) -> Vec<u32> {
        let mut g: Vec<u32> = (0..self.layers + self.state_layers)
            .map(|i| self.group_of(i))
            .collect();
        g.sort_unstable();
        g.dedup();
        g
    }

    /// The sliding window of group `group` (`None` but for [`SLIDING_GROUP`]).
    pub fn window(&self, group: u32) -> Option<u64> {
        self.sliding
            .filter(|_| group == SLIDING_GROUP)
            .map(|(_, w)| w)
    }
}

impl ModelShape {
    /// The shape without the name: "28 layers, 8 KV heads, head size 128, bfloat16" (with
    /// ", MLA", the sliding window and the state layers where the model has them).
    pub fn details(&self) -> String {
        let mut d = format!(
            "{} layers, {} KV heads, head size {}, {}{}",
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.dtype.trim_start_matches("torch."),
            if self.mla { ", MLA" } else { "" }
        );
        if let Some((period, window)) = self.sliding {
            d += &format!(
                ", sliding window {window} on {} of {period} layers",
                period - 1
            );
        }
        if self.state_layers > 0 {
            d += &format!(", {} state layers", self.state_layers);
        }
        d
    }
}

impl fmt::Display for ModelShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name, self.details())
    }
}

/// The KV cache group of full-attention layers.
pub const FULL_GROUP: u32 = 0;
/// The KV cache group of sliding-window layers.
pub const SLIDING_GROUP: u32 = 1;
/// The KV cache group of Mamba-type state layers.
pub const STATE_GROUP: u32 = 2;

/// Every model shape the CLI knows, by `--model` name.
pub const MODELS: &[ModelShape] = &[
    ModelShape {
        name: "qwen3-0.6b",
        layers: 28,
        kv_heads: 8,
        head_dim: 128,
        elem_bytes: 2,
        dtype: "torch.bfloat16",
        mla: false,
        sliding: None,
        state_layers: 0,
        state_bytes: 0,
    },
    ModelShape {
        name: "llama3-8b",
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        elem_bytes: 2,
        dtype: "torch.bfloat16",
        mla: false,
        sliding: None,
        state_layers: 0,
        state_bytes: 0,
    },
    ModelShape {
        name: "deepseek-v2-lite",
        layers: 27,
        kv_heads: 1,
        head_dim: 576,
        elem_bytes: 2,
        dtype: "torch.bfloat16",
        mla: true,
        sliding: None,
        state_layers: 0,
        state_bytes: 0,
    },
    // A tiny shape for tests and emulated links (soft-RoCE under TCG).
    ModelShape {
        name: "tiny",
        layers: 4,
        kv_heads: 2,
        head_dim: 64,
        elem_bytes: 2,
        dtype: "torch.bfloat16",
        mla: false,
        sliding: None,
        state_layers: 0,
        state_bytes: 0,
    },
    // A tiny hybrid: full attention, sliding-window attention and Mamba-type state layers,
    // three KV cache groups (as vLLM's hybrid KV cache manager keeps them).
    ModelShape {
        name: "tiny-hybrid",
        layers: 4,
        kv_heads: 2,
        head_dim: 64,
        elem_bytes: 2,
        dtype: "torch.bfloat16",
        mla: false,
        sliding: Some((2, 48)),
        state_layers: 2,
        state_bytes: 2048,
    },
];

/// Looks a model up by name.
///
/// Errors: an unknown name, with the list of known ones.
pub fn model_by_name(name: &str) -> Result<&'static ModelShape, UnknownModel> {
    MODELS
        .iter()
        .find(|m| m.name == name)
        .ok_or_else(|| UnknownModel(name.to_string()))
}

/// `--model`'s parser: the names of [`MODELS`] as clap's possible values, each with its shape
/// as help, so that every command's help lists them from this one table.
pub fn model_parser() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(
        MODELS
            .iter()
            .map(|m| clap::builder::PossibleValue::new(m.name).help(m.details())),
    )
}

/// A `--model` name not in the built-in table; the message lists the known ones.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown --model {name:?}; known: {}", MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", "), name = .0)]
pub struct UnknownModel(pub String);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen_bytes_per_token() {
        // 28 layers × 8 heads × (K+V) × 128 × 2 bytes
        assert_eq!(
            model_by_name("qwen3-0.6b").unwrap().bytes_per_token(),
            28 * 8 * 2 * 128 * 2
        );
        assert_eq!(
            model_by_name("deepseek-v2-lite").unwrap().bytes_per_token(),
            27 * 576 * 2
        );
    }

    /// README's synopsis of `demo` lists the same models as the table, in its order.
    #[test]
    fn readme_lists_every_model() {
        let readme = include_str!("../README.md");
        let at = readme.find("[--model ").expect("README names --model") + "[--model ".len();
        let listed = &readme[at..][..readme[at..].find(']').unwrap()];
        let names: Vec<&str> = MODELS.iter().map(|m| m.name).collect();
        assert_eq!(listed.split('|').collect::<Vec<_>>(), names);
    }

    #[test]
    fn details_leave_out_the_name() {
        let m = model_by_name("deepseek-v2-lite").unwrap();
        assert_eq!(
            m.details(),
            "27 layers, 1 KV heads, head size 576, bfloat16, MLA"
        );
        let h = model_by_name("tiny-hybrid").unwrap();
        assert_eq!(
            h.to_string(),
            "tiny-hybrid (4 layers, 2 KV heads, head size 64, bfloat16, sliding window 48 on 1 of 2 \
             layers, 2 state layers)"
        );
    }

    #[test]
    fn unknown_model_lists_known() {
        let e = model_by_name("gpt-9").unwrap_err();
        assert!(e.to_string().contains("llama3-8b"), "{e}");
    }
}
