use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    timeoutd::cli::main(timeoutd::cli::Cli::parse())
}
