//! Text ↔ token ids through the `tokenizers` crate (Hugging Face's `tokenizer.json`), and an
//! incremental decoder for streaming text as tokens arrive.
//!
//! Must not: know about the model or the ranks; the coordinator owns one of these.

use std::path::{Path, PathBuf};

use super::ModelError;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, ModelError> {
        Self::from_file(&dir.join("tokenizer.json"))
    }

    pub fn from_file(path: &Path) -> Result<Tokenizer, ModelError> {
        if !path.exists() {
            return Err(ModelError::Tokenizer {
                file: path.into(),
                why: "not found (the model folder needs a tokenizer.json)".into(),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| ModelError::Tokenizer {
            file: path.into(),
            why: format!("cannot load: {e}"),
        })?;
        Ok(Tokenizer {
            inner,
            path: path.into(),
        })
    }

    fn err(&self, what: &str, e: tokenizers::Error) -> ModelError {
        ModelError::Tokenizer {
            file: self.path.clone(),
            why: format!("{what}: {e}"),
        }
    }

    /// Token ids of `text`, with the special tokens the tokenizer's post-processor adds (BOS
    /// for Llama-style tokenizers).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| self.err("encode", e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String, ModelError> {
        self.inner
            .decode(ids, true)
            .map_err(|e| self.err("decode", e))
    }

    /// The tokenizer's vocab size, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token string (e.g. "<s>"), if it has one.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}

/// Turns a growing list of generated ids into text pieces. Decodes the whole list each time
/// and emits what is new, holding back text that ends in an incomplete UTF-8 sequence (shown
/// by the decoder as U+FFFD) until the next token completes it. Decoding the whole list keeps
/// decoders that depend on context (a stripped leading space, byte fallback) right.
#[derive(Default)]
pub struct TextStream {
    ids: Vec<u32>,
    emitted: usize,
}

impl TextStream {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one token and returns the new text, if any is complete.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>, ModelError> {
        self.ids.push(id);
        let text = tok.decode(&self.ids)?;
        if text.ends_with('\u{FFFD}')
            || text.len() <= self.emitted
            || !text.is_char_boundary(self.emitted)
        {
            return Ok(None);
        }
        let new = text[self.emitted..].to_string();
        self.emitted = text.len();
        Ok(Some(new))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_stream_holds_back_split_utf8() {
        let dir = std::env::temp_dir().join(format!("tprun-tok-stream-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("tokenizer.json"),
            crate::model::synth::tokenizer_json().to_string(),
        )
        .unwrap();
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let text = "a🦀é";
        let ids = tok.encode(text).unwrap();
        let mut s = TextStream::new();
        let pieces: Vec<Option<String>> = ids.iter().map(|&i| s.push(&tok, i).unwrap()).collect();
        // BOS, "a", then the crab's four bytes (three held back), then é's two bytes.
        assert_eq!(pieces[1].as_deref(), Some("a"));
        assert_eq!(pieces[2..5], [None, None, None]);
        assert_eq!(pieces[5].as_deref(), Some("🦀"));
        assert_eq!(pieces[6], None);
        assert_eq!(pieces[7].as_deref(), Some("é"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
