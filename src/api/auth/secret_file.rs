//! The generated HS256 secret of an embedded deployment: random, made on
//! first start, kept beside the SQLite file with mode 0600 so that
//! `tether token` signs what the server verifies.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use base64::Engine;

use crate::config::MIN_SECRET_BYTES;

#[derive(Debug, thiserror::Error)]
pub enum SecretFileError {
    #[error("cannot read or write the secret file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the secret file {path} is readable by others; make it mode 0600 or set TETHER_JWT_SECRET"
    )]
    Exposed { path: PathBuf },
    #[error(
        "the secret file {path} holds fewer than {MIN_SECRET_BYTES} bytes; remove it to make a new one"
    )]
    Short { path: PathBuf },
    #[error("no randomness for a new secret: {0}")]
    Random(String),
}

/// The secret in `path`, made first when the file does not exist.
pub fn load_or_create(path: &Path) -> Result<String, SecretFileError> {
    match read(path) {
        Err(SecretFileError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            create(path)?;
            read(path)
        }
        other => other,
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SecretFileError + '_ {
    move |source| SecretFileError::Io {
        path: path.to_owned(),
        source,
    }
}

fn read(path: &Path) -> Result<String, SecretFileError> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(path)
            .map_err(io(path))?
            .permissions()
            .mode();
        if mode & 0o077 != 0 {
            return Err(SecretFileError::Exposed {
                path: path.to_owned(),
            });
        }
    }
    let secret = text.trim().to_owned();
    if secret.len() < MIN_SECRET_BYTES {
        return Err(SecretFileError::Short {
            path: path.to_owned(),
        });
    }
    Ok(secret)
}

/// Writes a fresh secret to a file of its own, then links it into place:
/// two processes starting at once agree on one secret, and nobody reads a
/// half-written file.
fn create(path: &Path) -> Result<(), SecretFileError> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| SecretFileError::Random(e.to_string()))?;
    let secret = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    let mut staging = path.as_os_str().to_owned();
    staging.push(format!(".{}", uuid::Uuid::now_v7().simple()));
    let staging = PathBuf::from(staging);
    let written = write_private(&staging, &secret);
    let linked = written.and_then(|()| match std::fs::hard_link(&staging, path) {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        other => other,
    });
    let _ = std::fs::remove_file(&staging);
    linked.map_err(io(path))
}

fn write_private(path: &Path, secret: &str) -> std::io::Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(0o600);
    }
    let mut file = options.open(path)?;
    file.write_all(secret.as_bytes())?;
    file.write_all(b"\n")?;
    file.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tether-secret-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_first_call_makes_a_private_secret_and_later_calls_read_it() {
        let dir = scratch();
        let path = dir.join("tether.db.jwt-secret");
        let first = load_or_create(&path).unwrap();
        assert!(first.len() >= MIN_SECRET_BYTES);
        assert_eq!(load_or_create(&path).unwrap(), first);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        // No staging file is left behind.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        let other = dir.join("other.db.jwt-secret");
        assert_ne!(load_or_create(&other).unwrap(), first);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn a_file_others_can_read_or_a_short_one_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = scratch();
        let path = dir.join("open.jwt-secret");
        std::fs::write(&path, "x".repeat(40)).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            load_or_create(&path),
            Err(SecretFileError::Exposed { .. })
        ));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&path, "short").unwrap();
        assert!(matches!(
            load_or_create(&path),
            Err(SecretFileError::Short { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
