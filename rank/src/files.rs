//! Reading the small files a job starts from (a model folder's JSON files, a prompt, a job
//! token) without trusting what the path names: a FIFO, a device such as /dev/zero or a
//! many-gigabyte file must give an error, not a hang or an exhausted memory.
//!
//! Must not: know what the files hold.

use std::io::{self, Read};
use std::path::Path;

/// The most any of a model folder's JSON files may hold (tokenizer.json is the largest: ~11
/// MB for Qwen's 151k-token vocabulary, ~30 MB for the largest known).
pub const JSON_LIMIT: u64 = 256 << 20;

/// `path`'s bytes, at most `limit` of them (more is an error saying so). Reads whatever the
/// path is, so that `/dev/stdin` and a shell's `<(...)` work; an endless source stops at the
/// limit.
pub fn read_bounded(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(limit + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("larger than {limit} bytes"),
        ));
    }
    Ok(bytes)
}

/// [`read_bounded`] as text (UTF-8).
pub fn read_text(path: &Path, limit: u64) -> io::Result<String> {
    String::from_utf8(read_bounded(path, limit)?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "not UTF-8 text"))
}

/// An error unless `path` is a regular file (after symlinks): what a model folder's files must
/// be. Opening a FIFO would block until a writer comes; a directory or a device is no
/// checkpoint.
pub fn regular(path: &Path) -> io::Result<()> {
    match std::fs::metadata(path)?.is_file() {
        true => Ok(()),
        false => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        )),
    }
}

/// A model folder's JSON file as text: a regular file of at most [`JSON_LIMIT`] bytes.
pub fn read_json_text(path: &Path) -> io::Result<String> {
    regular(path)?;
    read_text(path, JSON_LIMIT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endless_sources_stop_at_the_limit() {
        let e = read_bounded(Path::new("/dev/zero"), 1 << 16).unwrap_err();
        assert!(e.to_string().contains("larger than 65536 bytes"), "{e}");
        assert!(read_json_text(Path::new("/dev/zero")).is_err());
    }

    #[test]
    fn model_files_must_be_regular() {
        let dir = std::env::temp_dir().join(format!("tprun-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("config.json");
        std::fs::write(&f, "{}").unwrap();
        assert_eq!(read_json_text(&f).unwrap(), "{}");
        assert_eq!(read_bounded(&f, 2).unwrap(), b"{}");
        assert!(read_bounded(&f, 1).is_err());
        let e = read_json_text(&dir).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        // A FIFO is refused before it is opened (opening it would wait for a writer).
        let fifo = dir.join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert!(regular(&fifo).is_err());
        assert!(read_json_text(&fifo).is_err());
        std::fs::write(&f, [0xff, 0xfe]).unwrap();
        assert!(read_json_text(&f)
            .unwrap_err()
            .to_string()
            .contains("UTF-8"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
