use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use tether::config::{Config, SecretSource};
use tether::server::{self, Role};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How often a runtime thread going idle hands the allocator's freed pages
/// back, at most.
const COLLECT_EVERY: Duration = Duration::from_secs(1);

/// Called when a runtime thread runs out of work. mimalloc frees a page
/// only once the thread that owns it looks at it again: after a burst (a
/// thousand sockets subscribing), memory freed on other threads stays
/// resident until then. An idle thread collects its heap, at most once a
/// second.
fn give_back_freed_memory() {
    thread_local! {
        static LAST: std::cell::Cell<Option<std::time::Instant>> = const { std::cell::Cell::new(None) };
    }
    let now = std::time::Instant::now();
    if LAST
        .get()
        .is_some_and(|last| now.duration_since(last) < COLLECT_EVERY)
    {
        return;
    }
    LAST.set(Some(now));
    // SAFETY: mi_collect has no preconditions; it runs on the calling
    // thread's own heap.
    unsafe { libmimalloc_sys::mi_collect(false) };
}

#[derive(Parser)]
#[command(name = "tether", version, about = "A durable agent-run server")]
struct Cli {
    /// The TOML configuration file [default: ./tether.toml when it exists,
    /// else the built-in demo agent].
    #[arg(long, global = true, env = "TETHER_CONFIG", value_name = "PATH")]
    config: Option<String>,
    /// Where the API listens [default: 127.0.0.1:8080].
    #[arg(
        long,
        global = true,
        env = "TETHER_LISTEN",
        value_name = "ADDRESS:PORT"
    )]
    listen: Option<String>,
    /// The database: sqlite://PATH (embedded), postgres:// or postgresql://
    /// [default: sqlite://tether.db?mode=rwc].
    // The value is not shown in --help: it may carry a password.
    #[arg(
        long,
        global = true,
        env = "TETHER_DATABASE_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    database_url: Option<String>,
    #[command(subcommand)]
    command: Option<Command>,
}

impl Cli {
    /// The process environment, with the values of these flags (which clap
    /// filled from their variables when the flags were not given) in place
    /// of their variables: a flag and its variable mean the same.
    fn env(&self) -> impl Fn(&str) -> Option<String> + '_ {
        move |name| match name {
            "TETHER_CONFIG" => self.config.clone(),
            "TETHER_LISTEN" => self.listen.clone(),
            "TETHER_DATABASE_URL" => self.database_url.clone(),
            _ => std::env::var(name).ok(),
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Migrate the database, then serve the API and run workers (the
    /// default).
    Serve {
        /// What this process runs: the API and the workers, or one of them
        /// (for split deployments).
        #[arg(long, value_enum, default_value = "all")]
        role: Role,
    },
    /// Apply migrations and exit.
    Migrate,
    /// Print a JWT signed with the configured secret (or the generated one).
    Token {
        /// The tenant the token acts in.
        #[arg(long, value_parser = non_empty)]
        tenant: String,
        /// The principal (the token's subject).
        #[arg(long, value_parser = non_empty)]
        sub: String,
        /// How long the token is valid, for example 30m, 1h, 7d.
        #[arg(long, default_value = "1h", value_parser = ttl)]
        ttl: Duration,
        /// An operator's token: it carries auth.operator_claim.
        #[arg(long)]
        operator: bool,
    },
    /// Print the GraphQL schema (SDL), as committed in schema.graphql.
    Schema,
    /// List runs (operators): `--stuck` for the runs nobody moves on.
    Runs {
        /// Leases expired without a reclaim, runs queued longer than
        /// --queued-longer-than, and runs waiting past their interaction's
        /// expiry.
        #[arg(long, required = true)]
        stuck: bool,
        /// How long a claimable run may wait before it is listed, for
        /// example 30s, 5m, 1h.
        #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
        queued_longer_than: Duration,
        /// One JSON object a line instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// List tool calls (operators): `--unknown` for those whose outcome is
    /// UNKNOWN, with their idempotency key and downstream target.
    ToolCalls {
        #[arg(long, required = true)]
        unknown: bool,
        /// One JSON object a line instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Work with the configuration file.
    Config {
        #[command(subcommand)]
        action: ConfigAction,
    },
}

#[derive(Subcommand)]
enum ConfigAction {
    /// Validate the configuration (the file, with the environment it names)
    /// and list the agents and tools it defines.
    Check,
}

/// A `--tenant` or `--sub`: a token with an empty one is refused by every
/// server.
fn non_empty(value: &str) -> Result<String, String> {
    if value.trim().is_empty() {
        return Err("must not be empty".to_owned());
    }
    Ok(value.to_owned())
}

/// A `--ttl`: a duration such as 30m, 1h or 7d, longer than zero.
fn ttl(value: &str) -> Result<Duration, String> {
    let ttl = humantime::parse_duration(value).map_err(|err| err.to_string())?;
    if ttl < Duration::from_secs(1) {
        return Err("must be at least one second: a token valid for no time is refused".to_owned());
    }
    Ok(ttl)
}

/// An error and its causes on one line, each cause once: a cause whose
/// text its wrapper already quotes is not repeated.
fn one_line(err: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

fn format(json: bool) -> tether::report::Format {
    if json {
        tether::report::Format::JsonLines
    } else {
        tether::report::Format::Table
    }
}

fn main() -> ExitCode {
    let mut cli = Cli::parse();
    let command = cli
        .command
        .take()
        .unwrap_or(Command::Serve { role: Role::All });
    if let Command::Schema = command {
        print!("{}", tether::api::sdl());
        return ExitCode::SUCCESS;
    }
    let config = match Config::load(&cli.env()) {
        Ok(config) => config,
        Err(err) => {
            eprintln!("tether: {err}");
            return ExitCode::from(2);
        }
    };
    // Held to the end: dropping it exports the last spans.
    let _logs = match tether::logs::init(&config.file.telemetry) {
        Ok(guard) => guard,
        Err(err) => {
            eprintln!("tether: cannot set up logs and traces: {err:#}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_park(give_back_freed_memory)
        .build()
    {
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
            Command::Token {
                tenant,
                sub,
                ttl,
                operator,
            } => {
                if let SecretSource::Generated(path) = config.secret_source()? {
                    eprintln!(
                        "tether: warning: TETHER_JWT_SECRET is not set: signing with the \
                         development secret generated in {}; a server with another secret \
                         refuses this token",
                        path.display()
                    );
                }
                let auth = server::authenticator(&config)?;
                let token = if operator {
                    auth.mint_operator(&tenant, &sub, ttl)?
                } else {
                    auth.mint(&tenant, &sub, ttl)?
                };
                println!("{token}");
                Ok(())
            }
            Command::Runs {
                queued_longer_than,
                json,
                ..
            } => {
                let store = server::open_store(&config).await?;
                let report =
                    tether::report::stuck_runs(&store, queued_longer_than, format(json)).await?;
                print!("{report}");
                Ok(())
            }
            Command::ToolCalls { json, .. } => {
                let store = server::open_store(&config).await?;
                let report =
                    tether::report::unknown_tool_calls(&store, &config.file, format(json)).await?;
                print!("{report}");
                Ok(())
            }
            Command::Config {
                action: ConfigAction::Check,
            } => {
                print!("{}", config.describe());
                Ok(())
            }
            Command::Schema => Ok(()),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("tether: {}", one_line(&err));
            ExitCode::FAILURE
        }
    }
}
