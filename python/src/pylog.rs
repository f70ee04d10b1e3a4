//! kvferry's `tracing` events → Python's `logging`, so that Python's `logging` sees kvferry's log
//! lines.
//!
//! A `tracing` layer formats each event (message and fields) and hands it to
//! `logging.getLogger(name).log(level, text)`, where `name` is the event's target under the
//! `kvferry` logger: `kvferry_transfer::engine` → `kvferry.transfer.engine`, this module's `_kvferry::engine` →
//! `kvferry.python.engine`, any other target
//! `t` → `kvferry.t`. Python's own levels and handlers then decide what is shown (by default
//! only warnings and errors reach stderr).
//!
//! Which events are forwarded at all is fixed when the module is imported: the `KVFERRY_LOG`
//! environment variable (tracing `EnvFilter` syntax, e.g. `debug` or
//! `kvferry_transfer=trace`), else `info`. Events below that never take the GIL.
//!
//! Deadlocks: an event from an engine thread takes the GIL to call `logging`. Every method of
//! `kvferry.TransferEngine` that touches the engine releases the GIL first (`py.detach`), so a
//! Python thread never holds the GIL while it waits on an engine thread that waits for the GIL.
//! While the interpreter shuts down the event is dropped (`Python::try_attach`).

use kvferry_transfer::sync::MutexExt;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Mutex;

use pyo3::prelude::*;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The Python logger name of a tracing target (see the module docs).
pub(crate) fn logger_name(target: &str) -> String {
    let dotted = target.replace("::", ".");
    if let Some(rest) = dotted.strip_prefix("_kvferry") {
        // this extension crate itself
        format!("kvferry.python{rest}")
    } else if dotted == "kvferry" || dotted.starts_with("kvferry.") {
        dotted
    } else if let Some(rest) = dotted.strip_prefix("kvferry_") {
        format!("kvferry.{rest}")
    } else {
        format!("kvferry.{dotted}")
    }
}

/// Python `logging` level number of a tracing level (TRACE → 5, below DEBUG).
fn py_level(l: &Level) -> i32 {
    match *l {
        Level::ERROR => 40,
        Level::WARN => 30,
        Level::INFO => 20,
        Level::DEBUG => 10,
        Level::TRACE => 5,
    }
}

/// Collects an event's message and `key=value` fields into one line.
#[derive(Default)]
struct Line {
    message: String,
    fields: String,
}

impl Visit for Line {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={value}", field.name());
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }
}

/// The layer: one cached `logging.Logger` per target.
struct PyLogLayer {
    loggers: Mutex<HashMap<&'static str, Py<PyAny>>>,
}

impl PyLogLayer {
    fn emit(&self, py: Python<'_>, target: &'static str, level: i32, text: &str) -> PyResult<()> {
        let cached = self.loggers.locked().get(target).map(|l| l.clone_ref(py));
        let logger = match cached {
            Some(l) => l,
            None => {
                let l = py
                    .import("logging")?
                    .call_method1("getLogger", (logger_name(target),))?
                    .unbind();
                self.loggers.locked().insert(target, l.clone_ref(py));
                l
            }
        };
        logger.call_method1(py, "log", (level, text))?;
        Ok(())
    }
}

impl<S: Subscriber> Layer<S> for PyLogLayer {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        let mut line = Line::default();
        event.record(&mut line);
        let text = if line.fields.is_empty() {
            line.message
        } else {
            format!("{}{}", line.message, line.fields)
        };
        let level = py_level(meta.level());
        Python::try_attach(|py| {
            if let Err(e) = self.emit(py, meta.target(), level, &text) {
                // A failing handler must not take the engine down; Python prints it.
                e.print(py);
            }
        });
    }
}

/// Installs the forwarding subscriber as the process's global default (once; a second call,
/// or another library's subscriber already installed, leaves things as they are).
pub fn install() {
    let filter = EnvFilter::try_from_env("KVFERRY_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let layer = PyLogLayer {
        loggers: Mutex::new(HashMap::new()),
    };
    let _ = tracing_subscriber::registry()
        .with(layer.with_filter(filter))
        .try_init();
}
