//! The `kvferry` command (DESIGN.md §6).

use std::io::{IsTerminal, Read, Write};
use std::process::ExitCode;

use clap::Parser;
use kvferry::cli::{Cli, Command, PayloadAction};

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log.as_deref());
    let result = match cli.command {
        Command::Demo(args) => kvferry::demo::run(&args),
        Command::Serve(args) => kvferry::roles::serve(&args),
        Command::Load(args) => kvferry::roles::load(&args),
        Command::Bench(args) => kvferry::bench::run(&args),
        Command::Checksum(_args) => Err("not yet".into()),
        Command::Payload { action } => payload(action),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("kvferry: error: {msg}");
            ExitCode::from(1)
        }
    }
}

fn init_tracing(filter: Option<&str>) {
    use tracing_subscriber::EnvFilter;
    let filter = filter
        .map(str::to_string)
        .or_else(|| std::env::var("KVFERRY_LOG").ok())
        .unwrap_or_else(|| "info".to_string());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_new(&filter).unwrap_or_else(|_| EnvFilter::new("info")))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

fn print_json(v: &serde_json::Value) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, v).map_err(|e| e.to_string())?;
    writeln!(out).map_err(|e| e.to_string())
}

fn payload(action: PayloadAction) -> Result<(), String> {
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .map_err(|e| format!("reading stdin: {e}"))?;
    match action {
        PayloadAction::Decode => print_json(&serde_json::Value::Null),
        PayloadAction::Encode => {
            let text = input.clone();
            println!("{text}");
            Ok(())
        }
    }
}
