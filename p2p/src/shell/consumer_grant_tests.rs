//! The consumer's grant per mode: an engine with a secret gets a grant on the load's bytes, an
//! open one none (it checks none), and the request carries the token either way.

use std::sync::Arc;

use kvferry_checksum::group::{LayerSpec, RankInfo, ReplicaKey};
use kvferry_checksum::layout::{ElemBytes, Geometry, Layout};
use kvferry_kernels::{CpuBackend, LayerInput};
use kvferry_transfer::{EngineConfig, Location, Secret, TransferEngine, TransportKind};

use super::Consumer;
use crate::proto::request::{build_request, LoadGroup, LoadSpec};
use crate::shell::consumer_config::ConsumerConfig;
use crate::worker::{Worker, WorkerGroup};

/// A TP 1 consumer of two layers of 4 blocks at made-up addresses (the grant reads no memory).
fn consumer(secret: Option<Secret>) -> Consumer {
    let mut config = EngineConfig {
        host: "127.0.0.1".into(),
        port: 0,
        transport: TransportKind::Tcp,
        ..EngineConfig::default()
    };
    config.auth.secret = secret;
    let engine = TransferEngine::new(config).unwrap();
    let layers = (0..2u32)
        .map(|layer| {
            let geometry = Geometry::contiguous(
                Layout::parse("KV B N H D").unwrap(),
                4,
                16,
                2,
                8,
                ElemBytes::new(2).unwrap(),
                1,
            )
            .unwrap();
            let len = geometry.byte_len();
            LayerInput {
                spec: LayerSpec {
                    name: format!("model.layers.{layer}.attn"),
                    layer,
                    head_offset: 0,
                    geometry,
                    kind: None,
                    dtype: None,
                    replica: ReplicaKey::NONE,
                },
                addr: (1 << 40) + layer as u64 * (1 << 20),
                len,
            }
        })
        .collect();
    let worker = Worker {
        rank: RankInfo {
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            pp_size: 1,
        },
        engine,
        device: Location::Cpu,
        groups: vec![WorkerGroup {
            group_id: 0,
            block_size: 16,
            layers,
            sliding_window: None,
            skipped: None,
        }],
        backend: Arc::new(CpuBackend::new(1)),
    };
    Consumer::new(ConsumerConfig::default(), vec![worker]).unwrap()
}

fn request(c: &Consumer) -> crate::proto::msg::LoadRequest {
    let spec = LoadSpec {
        request_id: "r".into(),
        producer: "tcp://127.0.0.1:1".into(),
        groups: vec![LoadGroup {
            group_id: 0,
            remote_blocks: vec![Some(0), Some(1)],
            local_blocks: vec![Some(2), Some(0)],
            remote_block_size: None,
        }],
        num_local_computed: 0,
        num_tokens: 32,
        load_key: None,
    };
    build_request(&c.layouts, 1, 1, &spec).unwrap().0
}

#[test]
fn an_engine_with_a_secret_gets_a_grant_an_open_one_none_and_both_a_token() {
    let secret = Secret::from_bytes(b"p2p test shared secret, 32 bytes").unwrap();
    let c = consumer(Some(secret));
    let (token, guards) = c.grant(&request(&c)).unwrap();
    assert_eq!(guards.len(), 1);
    assert_eq!(token, Some(guards[0].token()));
    assert_eq!(c.workers[0].engine.live_grants(), 1);
    drop(guards);
    assert_eq!(c.workers[0].engine.live_grants(), 0);

    let c = consumer(None);
    let (token, guards) = c.grant(&request(&c)).unwrap();
    assert!(guards.is_empty());
    assert!(token.is_some(), "the FINISH still proves a token");
    assert_eq!(c.workers[0].engine.live_grants(), 0);
}
