//! The bench's target side: an engine with one registered buffer that initiators READ and
//! WRITE (Mooncake's `transfer_engine_bench --mode=target`). In `--mode target` it runs in its
//! own process until killed; the loopback form runs it inside the initiator's process.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use kvferry_transfer::{
    EngineConfig, GrantGuard, GrantOps, GrantSpec, Secret, Token, TransferEngine,
};

use super::buffer::Buffer;
use crate::cli::BenchArgs;
use crate::error::CliError;

/// Label of the grant token both sides derive from a shared secret: the initiator of a
/// two-process run learns no token from the target, yet an authenticated target only lets
/// TCP data frames with a grant token through.
const BENCH_TOKEN_LABEL: &str = "kvferry/bench/token/v1";

/// The token an authenticated target grants on its bench buffer, derived from the secret and
/// the target's segment name (16 bytes of an HMAC-SHA256).
pub fn derived_token(secret: &Secret, segment: &str) -> Token {
    let mac = secret.prove(BENCH_TOKEN_LABEL, &[segment.as_bytes()]);
    let mut t = [0u8; 16];
    t.copy_from_slice(&mac[..16]);
    Token(t)
}

/// A running target: its engine, its registered buffer and the grant on it.
pub struct Target {
    /// The target's engine.
    pub engine: Arc<TransferEngine>,
    /// The registered buffer (unregistered on drop, before it is freed).
    pub buffer: Buffer,
    /// The token initiators present (the grant lives as long as the target).
    pub token: Option<Token>,
    _grant: Option<GrantGuard>,
}

impl Target {
    /// Starts an engine with `cfg`, allocates and registers `len` bytes at `args`'s device and
    /// grants READ and WRITE on them to `token` (a random one when `None` and the engine is
    /// open: the loopback form passes it to its initiator in process).
    ///
    /// Errors: the engine cannot start, the memory cannot be allocated or registered.
    pub fn start(
        cfg: EngineConfig,
        len: u64,
        args: &BenchArgs,
        token: Option<Token>,
    ) -> Result<Target, CliError> {
        let engine =
            TransferEngine::new(cfg).map_err(CliError::transfer("starting the target engine"))?;
        let buffer = Buffer::new(super::types::location(args), len)?;
        // SAFETY: the buffer outlives its registration: `Drop` unregisters it first.
        unsafe { engine.register_memory(buffer.addr(), buffer.len(), buffer.location()) }
            .map_err(CliError::transfer("registering the target buffer"))?;
        let token = match (token, engine.secret()) {
            (Some(t), _) => Some(t),
            (None, Some(s)) => Some(derived_token(s, &engine.segment_name())),
            (None, None) => Some(Token::random().map_err(CliError::transfer("a grant token"))?),
        };
        let grant = token
            .map(|token| {
                engine.grant(GrantSpec {
                    token,
                    ops: GrantOps {
                        write: true,
                        read: true,
                    },
                    ranges: vec![(buffer.addr(), buffer.len())],
                    ttl: Duration::from_secs(365 * 24 * 3600),
                })
            })
            .transpose()
            .map_err(CliError::transfer("granting the target buffer"))?;
        Ok(Target {
            engine,
            buffer,
            token,
            _grant: grant,
        })
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.engine.unregister_memory(self.buffer.addr());
    }
}

/// `kvferry bench --mode target`: serves a buffer of `--buffer-size` bytes until the process
/// is killed, after printing one line an initiator (or a script) reads its segment from.
///
/// Errors: as [`Target::start`].
pub fn serve(args: &BenchArgs, cfg: EngineConfig, len: u64) -> Result<(), CliError> {
    let t = Target::start(cfg, len, args, None)?;
    let path = t
        .engine
        .region_path(t.buffer.addr())
        .map_or_else(|| "unregistered".to_string(), |p| p.to_string());
    let auth = if t.engine.is_authenticated() {
        "authenticated (token derived from the secret)"
    } else {
        "open"
    };
    println!(
        "kvferry bench target: segment {} transport {} buffer {} bytes on {} ({path}), {auth}; run the initiator with --mode initiator --target {}",
        t.engine.segment_name(),
        t.engine.transport_name(),
        t.buffer.len(),
        t.buffer.location(),
        t.engine.segment_name(),
    );
    let _ = std::io::stdout().flush();
    loop {
        // Serving happens on the engine's own threads; this one only keeps them alive.
        std::thread::sleep(Duration::from_secs(3600));
    }
}
