use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use tether::config::Config;
use tether::server::{self, Role};
use tracing_subscriber::EnvFilter;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "tether", version, about = "A durable agent-run server")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Migrate the database, then serve the API and run workers.
    Serve {
        #[arg(long, value_enum, default_value = "all")]
        role: Role,
    },
    /// Apply migrations and exit.
    Migrate,
    /// Print a JWT signed with the configured secret (or the generated one).
    Token {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        sub: String,
        /// How long the token is valid, for example 30m, 1h, 7d.
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        ttl: Duration,
    },
    /// Print the GraphQL schema (SDL), as committed in schema.graphql.
    Schema,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let command = cli.command.unwrap_or(Command::Serve { role: Role::All });
    if let Command::Schema = command {
        print!("{}", tether::api::sdl());
        return ExitCode::SUCCESS;
    }
    let config = match Config::from_env() {
        Ok(config) => config,
        Err(err) => {
            eprintln!("tether: {err}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("tether: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match command {
            Command::Serve { role } => server::serve(config, role).await,
            Command::Migrate => server::open_store(&config).await.map(|_| ()),
            Command::Token { tenant, sub, ttl } => {
                let auth = server::authenticator(&config)?;
                println!("{}", auth.mint(&tenant, &sub, ttl)?);
                Ok(())
            }
            Command::Schema => Ok(()),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("tether: {err:#}");
            ExitCode::FAILURE
        }
    }
}
