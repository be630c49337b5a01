//! Sealing connection secrets at rest: AES-256-GCM with a fresh random
//! nonce per value, and the owner of the value (tenant, principal,
//! provider) as associated data, so a sealed value copied into another row
//! does not open. Each sealed value is stored beside the id of the key that
//! sealed it, so the key can be rotated later.

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use sha2::{Digest, Sha256};

const NONCE_LEN: usize = 12;

/// A sealed value that cannot be opened: another key, another row, or
/// damaged. Says nothing about the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a sealed value could not be opened ({0})")]
pub struct Unsealable(&'static str);

pub struct Cipher {
    aead: Aes256Gcm,
    key_id: String,
}

impl std::fmt::Debug for Cipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cipher")
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

/// The associated data that binds a value to its owner. Each part is
/// length-prefixed, so no two owners share one.
pub fn owner(parts: &[&str]) -> Vec<u8> {
    let mut data = Vec::new();
    for part in parts {
        data.extend_from_slice(&(part.len() as u64).to_be_bytes());
        data.extend_from_slice(part.as_bytes());
    }
    data
}

impl Cipher {
    pub fn new(key: &[u8; 32]) -> Cipher {
        // The id shows which key sealed a value without revealing the key:
        // the first bytes of a hash of it, under a label of its own.
        let digest = Sha256::new()
            .chain_update(b"tether connection key id\0")
            .chain_update(key)
            .finalize();
        let key_id = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        Cipher {
            aead: Aes256Gcm::new(key.into()),
            key_id,
        }
    }

    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// Seals `plaintext` for the owner `aad`: base64 of nonce and ciphertext.
    pub fn seal(&self, plaintext: &str, aad: &[u8]) -> String {
        let mut nonce = [0u8; NONCE_LEN];
        // The operating system's generator failing leaves nothing safe to do.
        getrandom::fill(&mut nonce).expect("the system's random number generator failed");
        let sealed = self
            .aead
            .encrypt(
                &Nonce::from(nonce),
                Payload {
                    msg: plaintext.as_bytes(),
                    aad,
                },
            )
            .expect("AES-GCM sealing cannot fail for values of this size");
        let mut bytes = nonce.to_vec();
        bytes.extend_from_slice(&sealed);
        STANDARD.encode(bytes)
    }

    /// Opens what `seal` made for the same owner under the key `key_id`.
    pub fn open(&self, key_id: &str, sealed: &str, aad: &[u8]) -> Result<String, Unsealable> {
        if key_id != self.key_id {
            return Err(Unsealable("sealed under another key"));
        }
        let bytes = STANDARD
            .decode(sealed)
            .map_err(|_| Unsealable("not base64"))?;
        if bytes.len() < NONCE_LEN {
            return Err(Unsealable("too short"));
        }
        let (nonce, ciphertext) = bytes.split_at(NONCE_LEN);
        let nonce: [u8; NONCE_LEN] = nonce.try_into().map_err(|_| Unsealable("too short"))?;
        let plain = self
            .aead
            .decrypt(
                &Nonce::from(nonce),
                Payload {
                    msg: ciphertext,
                    aad,
                },
            )
            .map_err(|_| Unsealable("authentication failed"))?;
        String::from_utf8(plain).map_err(|_| Unsealable("not text"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_value_opens_only_for_its_owner_and_key() {
        let cipher = Cipher::new(&[7; 32]);
        let aad = owner(&["acme", "ada", "github"]);
        let sealed = cipher.seal("gho_secret", &aad);
        assert!(!sealed.contains("gho_secret"));
        assert_eq!(
            cipher.open(cipher.key_id(), &sealed, &aad).unwrap(),
            "gho_secret"
        );
        // Fresh nonce each time.
        assert_ne!(sealed, cipher.seal("gho_secret", &aad));
        for other in [
            owner(&["other", "ada", "github"]),
            owner(&["acme", "bob", "github"]),
            owner(&["acme", "ada", "gitlab"]),
            // Moving a boundary between parts is another owner too.
            owner(&["acme", "adagithub", ""]),
        ] {
            assert!(cipher.open(cipher.key_id(), &sealed, &other).is_err());
        }
        let other_key = Cipher::new(&[8; 32]);
        assert_ne!(other_key.key_id(), cipher.key_id());
        assert!(other_key.open(other_key.key_id(), &sealed, &aad).is_err());
        assert!(cipher.open(other_key.key_id(), &sealed, &aad).is_err());
        assert!(!format!("{cipher:?}").contains("7, 7"));
    }
}
