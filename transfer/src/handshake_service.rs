//! The handshake service (docs/design.md §3 "Handshake"): what this engine answers on its
//! handshake listener, frame by frame. `handshake` owns the frames, the listener and the
//! client; this file owns the answers and the auth gate in front of them:
//!
//! - `Hello` → a fresh 32-byte nonce for this connection and, with a secret, this engine's
//!   proof over both nonces and both names (`crate::auth::on_hello`; a `Hello` naming another
//!   segment is refused);
//! - `Auth` → checks the initiator's proof over that `Hello`, or a live grant token
//!   (`crate::auth`); refusals are counted and logged within a rate limit
//!   (`AuthState::refused`);
//! - `Descriptor` → this engine's descriptor (`SegmentDescriptor::build`, JSON);
//! - `Connect` → the transport's own connection set-up (`Transport::on_handshake`);
//! - `Error` → refused (it is a reply, not a request).
//!
//! In authenticated mode `Descriptor` and `Connect` pass the gate only on a connection that
//! passed `Auth`; in open mode every frame passes.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use crate::admission::Limits;
use crate::auth::AuthState;
use crate::config::EngineConfig;
use crate::descriptor::SegmentDescriptor;
use crate::error::{AuthError, IoError, ProtocolError, Result, TransferError};
use crate::handshake::{FrameType, HandshakeServer, Session};
use crate::memory::MemoryRegistry;
use crate::transport::Transport;

/// Binds the handshake listener on `host` (brackets allowed around an IPv6 address) at
/// `config.port` (0 = any port; else within `config.listen_ports`); returns it and the segment
/// name, `host:port` of the port bound. Errors: `Bind` naming the address tried, `Io` when the
/// bound address cannot be read.
pub(crate) fn bind(host: &str, config: &EngineConfig) -> Result<(TcpListener, String)> {
    let bind_host = crate::ports::unbracket(host);
    let listener = crate::ports::bind_listener(bind_host, config.port, config.listen_ports)
        .map_err(|e| {
            let at = crate::ports::listen_address(bind_host, config.port, config.listen_ports);
            TransferError::Bind(IoError::new(format!("bind handshake listener on {at}"), e))
        })?;
    let port = listener
        .local_addr()
        .map_err(|e| TransferError::io("handshake listener address", e))?
        .port();
    Ok((listener, crate::ports::host_port(bind_host, port)))
}

/// What the handshake service answers from: the engine's name, instance id, registry,
/// transport and auth state (shared with the engine).
pub(crate) struct HandshakeService {
    pub name: String,
    pub instance_id: u64,
    pub registry: Arc<MemoryRegistry>,
    pub transport: Arc<dyn Transport>,
    pub auth: Arc<AuthState>,
}

impl HandshakeService {
    /// Serves `listener` with this service until the returned server is dropped; each
    /// connection's frames must arrive within `timeout`, connections are admitted per `limits`.
    /// Errors: the server's (its accept thread cannot start).
    pub(crate) fn start(
        self,
        listener: TcpListener,
        timeout: Duration,
        limits: Limits,
    ) -> Result<HandshakeServer> {
        let service = Arc::new(self);
        let handler = move |ty: FrameType, body: &[u8], session: &mut Session| {
            service.handle(ty, body, session)
        };
        HandshakeServer::start_limited(listener, Arc::new(handler), timeout, limits)
    }

    /// This engine's descriptor now (its registered buffers).
    pub(crate) fn descriptor(&self) -> SegmentDescriptor {
        SegmentDescriptor::build(
            &self.name,
            self.instance_id,
            self.transport.local_info(),
            &self.registry,
        )
    }

    /// `Ok` when `session` may ask for descriptors and connects: it passed `Auth`, or the
    /// engine is open. Errors: `Auth(NotAuthenticated)`.
    fn gate(&self, session: &Session) -> Result<()> {
        if self.auth.enforced() && !session.authed {
            return Err(TransferError::Auth(AuthError::NotAuthenticated));
        }
        Ok(())
    }

    /// The reply body to one request frame; an `Err` goes back as an error frame.
    pub(crate) fn handle(
        &self,
        ty: FrameType,
        body: &[u8],
        session: &mut Session,
    ) -> Result<Vec<u8>> {
        match ty {
            FrameType::Descriptor => {
                self.gate(session)?;
                serde_json::to_vec(&self.descriptor()).map_err(|e| {
                    TransferError::Protocol(ProtocolError::Encode {
                        what: "descriptor",
                        source: e.into(),
                    })
                })
            }
            FrameType::Connect => {
                self.gate(session)?;
                self.transport.on_handshake(session.peer, body)
            }
            FrameType::Hello => crate::auth::on_hello(&self.auth, body, session.local)
                .map(|(pending, reply)| {
                    session.hello = Some(pending);
                    reply
                })
                .inspect_err(|e| self.auth.refused(session.peer, e)),
            FrameType::Auth => {
                if self.auth.enforced() {
                    crate::auth::check_auth_body(&self.auth, body, session.hello.take())
                        .inspect_err(|e| self.auth.refused(session.peer, e))?;
                }
                session.authed = true;
                Ok(Vec::new())
            }
            FrameType::Error => Err(TransferError::Protocol(ProtocolError::NotARequest("error"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;
    use crate::descriptor::TransportInfo;
    use crate::memory::{MemoryRegion, RegionKeys};
    use crate::transport::{CompletionSink, Slice};
    use crate::types::TransportKind;

    /// A transport that answers connects with `b"connected"` and moves nothing.
    struct Answering;

    impl Transport for Answering {
        fn kind(&self) -> TransportKind {
            TransportKind::Tcp
        }
        fn local_info(&self) -> TransportInfo {
            TransportInfo {
                kind: TransportKind::Tcp,
                details: serde_json::json!({}),
            }
        }
        fn register(&self, _region: &MemoryRegion) -> Result<RegionKeys> {
            Ok(RegionKeys::default())
        }
        fn deregister(&self, _region: &MemoryRegion) -> Result<()> {
            Ok(())
        }
        fn on_handshake(&self, _peer: SocketAddr, _body: &[u8]) -> Result<Vec<u8>> {
            Ok(b"connected".to_vec())
        }
        fn post(
            &self,
            _peer: &Arc<SegmentDescriptor>,
            slices: &[Slice],
            done: CompletionSink,
            _token: Option<crate::auth::Token>,
        ) {
            let e = TransferError::Unsupported(crate::error::UnsupportedError::ShutDown {
                transport: "test",
            });
            done.fail_all(slices.iter().map(|s| s.id), &e);
        }
    }

    fn service(secret: Option<crate::auth::Secret>) -> HandshakeService {
        HandshakeService {
            name: "h:1".into(),
            instance_id: 7,
            registry: Arc::new(MemoryRegistry::new()),
            transport: Arc::new(Answering),
            auth: AuthState::new(secret, "h:1"),
        }
    }

    fn session() -> Session {
        Session {
            peer: "127.0.0.1:9".parse().unwrap(),
            local: None,
            hello: None,
            authed: false,
        }
    }

    #[test]
    fn an_open_engine_answers_descriptors_and_connects_at_once() {
        let s = service(None);
        let mut sess = session();
        let d = s.handle(FrameType::Descriptor, b"", &mut sess).unwrap();
        let d: SegmentDescriptor = serde_json::from_slice(&d).unwrap();
        assert_eq!((d.name.as_str(), d.instance_id), ("h:1", 7));
        assert_eq!(d.transport.kind, TransportKind::Tcp);
        assert_eq!(
            s.handle(FrameType::Connect, b"x", &mut sess).unwrap(),
            b"connected"
        );
        assert!(s.handle(FrameType::Error, b"", &mut sess).is_err());
    }

    #[test]
    fn an_authenticated_engine_answers_only_after_auth() {
        let secret = crate::auth::Secret::from_bytes(&[7; 32]).unwrap();
        let s = service(Some(secret.clone()));
        let mut sess = session();
        for ty in [FrameType::Descriptor, FrameType::Connect] {
            let e = s.handle(ty, b"", &mut sess).unwrap_err();
            assert!(
                matches!(e, TransferError::Auth(AuthError::NotAuthenticated)),
                "{e}"
            );
        }
        // a wrong proof leaves the connection unauthenticated
        let hello = crate::auth::Hello::new("h:1", "i:2").unwrap();
        s.handle(FrameType::Hello, &hello.encode(), &mut sess)
            .unwrap();
        assert!(s.handle(FrameType::Auth, &[1; 33], &mut sess).is_err());
        assert!(s.handle(FrameType::Descriptor, b"", &mut sess).is_err());
        // the right proof over this connection's Hello opens it (after the target proved it)
        let reply = s
            .handle(FrameType::Hello, &hello.encode(), &mut sess)
            .unwrap();
        let cred = crate::auth::Credential::Secret {
            secret,
            initiator: "i:2".into(),
        };
        let body = crate::auth::answer_hello(&cred, &hello, &reply).unwrap();
        s.handle(FrameType::Auth, &body, &mut sess).unwrap();
        s.handle(FrameType::Descriptor, b"", &mut sess).unwrap();
        assert_eq!(
            s.handle(FrameType::Connect, b"", &mut sess).unwrap(),
            b"connected"
        );
    }
}
