//! Text ↔ token ids through the `tokenizers` crate (Hugging Face's `tokenizer.json`), and an
//! incremental decoder for streaming text as tokens arrive.
//!
//! The coordinator's alone: it tokenizes the prompt before any rank starts and turns rank 0's
//! tokens into text; ranks only ever see ids. Must not: know about the model or the ranks.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Result};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    /// The model's vocab size, where known ([`Tokenizer::for_vocab`]): encoded ids must be
    /// below it (a tokenizer whose added tokens outgrow the model's embedding).
    vocab: Option<usize>,
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(anyhow!(
                "{}: not found (the model folder needs a tokenizer.json)",
                path.display()
            ));
        }
        let json = tprun_rank::files::read_json_text(&path)
            .map_err(|e| anyhow!("{}: {e}", path.display()))?;
        Self::from_json(&path.display().to_string(), json.as_bytes())
    }

    /// A tokenizer from `tokenizer.json`'s contents, called `name` in messages (the file's
    /// path, or the embedded default model's name, which has no file).
    pub fn from_json(name: &str, json: &[u8]) -> Result<Tokenizer> {
        let cannot = |why: String| anyhow!("{name}: cannot load: {why}");
        // Parsed into a value first: the tokenizers crate (0.22) panics instead of returning
        // its error on a syntax error inside the "decoder" object (found by fuzzing).
        let value: serde_json::Value =
            serde_json::from_slice(json).map_err(|e| cannot(format!("not valid JSON: {e}")))?;
        refuse_unchecked_parts(&value).map_err(cannot)?;
        let mut inner = serde_json::from_value::<tokenizers::Tokenizer>(value)
            .map_err(|e| cannot(e.to_string()))?;
        // The whole text, unpadded, as transformers encodes a prompt unless asked otherwise:
        // tprun checks the prompt against its context itself. (A truncation whose stride is not
        // below its max_length also panics inside the crate at encode.)
        inner
            .with_truncation(None)
            .map_err(|e| cannot(e.to_string()))?;
        inner.with_padding(None);
        Ok(Tokenizer {
            inner,
            path: PathBuf::from(name),
            vocab: None,
        })
    }

    /// The same tokenizer, its encoded ids checked against the model's `vocab` rows.
    pub fn for_vocab(self, vocab: usize) -> Tokenizer {
        Tokenizer {
            vocab: Some(vocab),
            ..self
        }
    }

    /// `ids`, or an error naming the first that the model has no row for.
    fn checked(&self, ids: &[u32]) -> Result<Vec<u32>> {
        let vocab = self.vocab.unwrap_or(usize::MAX);
        match ids.iter().find(|&&id| id as usize >= vocab) {
            Some(id) => Err(anyhow!(
                "{}: gives token id {id}, outside the model's vocab of {vocab} \
                 (vocab_size in config.json)",
                self.path.display()
            )),
            None => Ok(ids.to_vec()),
        }
    }

    fn err(&self, what: &str, e: tokenizers::Error) -> anyhow::Error {
        anyhow!("{}: {what}: {e}", self.path.display())
    }

    /// Token ids of `text` without the post-processor's special tokens (a chat template
    /// writes its own BOS).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| self.err("encode", e))?;
        self.checked(enc.get_ids())
    }

    /// Token ids of `text`, with the special tokens the tokenizer's post-processor adds (BOS
    /// for Llama-style tokenizers).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| self.err("encode", e))?;
        self.checked(enc.get_ids())
    }

    /// Text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| self.err("decode", e))
    }
}

/// Refuses the parts of a tokenizer.json that the tokenizers crate (0.22) deserializes without
/// the checks its builders make, and then panics on. Parts are recognised by their fields, not
/// by their `"type"`: the crate's untagged enums take an object of the right shape whatever
/// its type says (found by fuzzing).
/// - a `Precompiled` normalizer (SentencePiece's character map, which no supported model's
///   tokenizer uses): a panic at load when its fields are missing, and its trie is indexed
///   unchecked at every encode;
/// - a `TemplateProcessing` post-processor whose template names a special token it does not
///   define: a panic at every encode (found by fuzzing);
/// - a `Strip` decoder with `stop` > 0: it indexes back from each token's end without
///   checking the token's length, so an empty or short token panics at decode (found by
///   fuzzing). Llama's and Mistral's tokenizers strip at the start only (`stop` 0).
fn refuse_unchecked_parts(tokenizer: &serde_json::Value) -> Result<(), String> {
    use serde_json::{Map, Value};
    type Object = Map<String, Value>;
    // Every object in `v` for which `check` fails, however deeply nested (Sequence).
    fn each(v: &Value, check: &dyn Fn(&Object) -> Result<(), String>) -> Result<(), String> {
        match v {
            Value::Object(o) => {
                check(o)?;
                o.values().try_for_each(|c| each(c, check))
            }
            Value::Array(a) => a.iter().try_for_each(|c| each(c, check)),
            _ => Ok(()),
        }
    }
    let part = |name: &str, check: &dyn Fn(&Object) -> Result<(), String>| {
        tokenizer.get(name).map_or(Ok(()), |v| each(v, check))
    };
    part("normalizer", &|o| {
        let precompiled = o.get("type").and_then(Value::as_str) == Some("Precompiled")
            || o.contains_key("precompiled_charsmap");
        match precompiled {
            true => Err("normalizer type \"Precompiled\" is not supported".into()),
            false => Ok(()),
        }
    })?;
    // `stop` is Strip's field alone among the decoders.
    part(
        "decoder",
        &|o| match o.get("stop").and_then(Value::as_u64) {
            Some(n) if n > 0 => {
                Err("decoder: a Strip decoder with \"stop\" > 0 is not supported".into())
            }
            _ => Ok(()),
        },
    )?;
    part("post_processor", &|o| {
        let Some(Value::Object(specials)) = o.get("special_tokens") else {
            return Ok(());
        };
        for template in ["single", "pair"] {
            let pieces = o
                .get(template)
                .and_then(Value::as_array)
                .into_iter()
                .flatten();
            for piece in pieces {
                let id = piece.pointer("/SpecialToken/id").and_then(Value::as_str);
                if let Some(id) = id.filter(|id| !specials.contains_key(*id)) {
                    return Err(format!(
                        "post_processor: the {template} template uses special token {id:?}, \
                         which special_tokens does not define"
                    ));
                }
            }
        }
        Ok(())
    })
}

/// Turns a growing list of generated ids into text pieces, each token's work bounded by a
/// window of a few ids rather than the whole list (decoding everything on every token made a
/// long generation quadratic: at 10 000 tokens the coordinator fell seconds behind the ranks,
/// and with it the supervision of their deaths).
///
/// The window starts one emitted piece back: `decode(window)` minus `decode(window without the
/// newest ids)` is the new text, so decoders that depend on context (a stripped leading space,
/// byte fallback) see the same neighbours as in a whole-list decode. Text ending in an
/// incomplete UTF-8 sequence (shown by the decoder as U+FFFD) is held back until the next token
/// completes it, or until the window holds `MAX_HELD` ids (then the replacement character is
/// real, and is emitted).
#[derive(Default)]
pub struct TextStream {
    /// The ids from the start of the previous emitted piece on.
    window: Vec<u32>,
    /// How many of `window` were already emitted.
    read: usize,
}

/// Ids held back waiting for the rest of a character: a UTF-8 sequence is at most 4 bytes,
/// and a byte-fallback token carries at least one.
const MAX_HELD: usize = 8;

/// Prompt ids a stream of generated ids starts after (see [`TextStream::after`]).
const CONTEXT: usize = 4;

impl TextStream {
    pub fn new() -> Self {
        Self::default()
    }

    /// A stream of the ids generated after `prompt`: its last few ids are the first window's
    /// context, so that the first piece is what it adds to the prompt's text. Without them a
    /// decoder that strips the leading space of a text (Llama's, Mistral's) took it from the
    /// first generated token: "Once upon a" went on "time", printed "Once upon atime".
    pub fn after(prompt: &[u32]) -> Self {
        let window = prompt[prompt.len().saturating_sub(CONTEXT)..].to_vec();
        Self {
            read: window.len(),
            window,
        }
    }

    /// Adds one token and returns the new text, if any is complete.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<Option<String>> {
        self.window.push(id);
        let before = tok.decode(&self.window[..self.read])?;
        let text = tok.decode(&self.window)?;
        let held = self.window.len() - self.read;
        let complete = !text.ends_with('\u{FFFD}') || held >= MAX_HELD;
        let new = (complete && text.len() > before.len() && text.is_char_boundary(before.len()))
            .then(|| text[before.len()..].to_string());
        if new.is_some() || held >= MAX_HELD {
            // The piece just emitted (or ids that gave no text, special tokens say) becomes
            // the next window's context.
            self.window.drain(..self.read);
            self.read = self.window.len();
        }
        Ok(new)
    }

    /// Ids kept for context and held back (at most a piece's worth, whatever was generated).
    #[cfg(test)]
    pub fn window_len(&self) -> usize {
        self.window.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tprun_rank::model::synth::{synth_ids, tokenizer_json, SYNTH_BOS};

    /// A folder holding the synthetic byte-level tokenizer.json.
    fn synth_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tprun-tok-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("tokenizer.json"),
            tokenizer_json(32000).to_string(),
        )
        .unwrap();
        dir
    }

    /// A truncation or padding setting in tokenizer.json is ignored (transformers encodes a
    /// prompt whole unless asked): even a stride not below max_length, on which the crate
    /// panics at encode, gives every id.
    #[test]
    fn truncation_and_padding_are_ignored() {
        let mut json = tokenizer_json(32000);
        json["truncation"] = serde_json::json!({"max_length": 3, "strategy": "LongestFirst",
                                                "stride": 5, "direction": "Right"});
        json["padding"] = serde_json::json!({"strategy": {"Fixed": 64}, "direction": "Right",
            "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "<|eos|>"});
        let t = Tokenizer::from_json("t", json.to_string().as_bytes()).unwrap();
        let text = "Once upon a time, far away";
        assert_eq!(t.encode(text).unwrap(), synth_ids(text));
    }

    /// With the model's vocab known, an id beyond it is an error naming the id, not a prompt
    /// that the ranks refuse after they started (or, in serve, that stops the job).
    #[test]
    fn ids_outside_the_models_vocab_are_refused() {
        let json = tokenizer_json(32000).to_string();
        let t = Tokenizer::from_json("t", json.as_bytes()).unwrap();
        let ids = t.encode("Az").unwrap();
        let top = *ids.iter().max().unwrap() as usize; // BOS
        let fits = Tokenizer::from_json("t", json.as_bytes())
            .unwrap()
            .for_vocab(top + 1);
        assert_eq!(fits.encode("Az").unwrap(), ids);
        let short = Tokenizer::from_json("t", json.as_bytes())
            .unwrap()
            .for_vocab(top);
        let err = short.encode("Az").unwrap_err().to_string();
        assert!(err.contains(&format!("token id {top}, outside")), "{err}");
        // Without BOS ('z' is the larger byte).
        assert_eq!(
            short.encode_plain("Az").unwrap(),
            [b'A' as u32, b'z' as u32]
        );
        let bytes = Tokenizer::from_json("t", json.as_bytes())
            .unwrap()
            .for_vocab(b'z' as usize);
        assert!(bytes.encode_plain("Az").is_err());
    }

    #[test]
    fn synth_tokenizer_round_trips_bytes() {
        let dir = synth_dir("bytes");
        let t = Tokenizer::from_dir(&dir).unwrap();
        let text = "Hello, wörld! 🦀\n\ttabs";
        let ids = t.encode(text).unwrap();
        assert_eq!(ids[0], SYNTH_BOS);
        assert_eq!(ids.len(), 1 + text.len());
        // What the rank crate's tests use instead of a tokenizer.
        assert_eq!(ids, synth_ids(text));
        assert_eq!(t.decode(&ids).unwrap(), text);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Every id of the vocab decodes to text (`synth --preset small` had a 32000-id vocab and
    /// a 258-id tokenizer: its text was empty), while encoding stays one id per byte.
    #[test]
    fn synth_tokenizer_covers_the_vocab() {
        let dir = synth_dir("cover");
        let t = Tokenizer::from_dir(&dir).unwrap();
        let mut seen = std::collections::HashSet::new();
        for id in 258..32000 {
            let text = t.decode(&[id]).unwrap();
            assert!(text.starts_with(' ') && text.len() > 1, "{id}: {text:?}");
            assert!(seen.insert(text), "{id} repeats a word");
        }
        assert_eq!(t.decode(&[258, 259, 358]).unwrap(), " ba be baba");
        assert_eq!(t.encode(" ba").unwrap(), synth_ids(" ba"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn text_stream_holds_back_split_utf8() {
        let dir = synth_dir("stream");
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

    /// A long generation streams to exactly its whole-list decode while the stream keeps only
    /// a few ids, and ids that give no text (BOS here, a special token) do not pile up.
    #[test]
    fn text_stream_window_stays_small() {
        let dir = synth_dir("long");
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let text = "Once upon a time, a crab 🦀 named Zoë counted façades; ".repeat(200);
        let mut ids = tok.encode(&text).unwrap();
        ids.extend(std::iter::repeat_n(SYNTH_BOS, 3 * MAX_HELD));
        ids.extend(tok.encode("the end").unwrap());
        let mut s = TextStream::new();
        let mut streamed = String::new();
        for &i in &ids {
            streamed.extend(s.push(&tok, i).unwrap());
            assert!(s.window_len() <= 2 * MAX_HELD, "{}", s.window_len());
        }
        assert_eq!(streamed, tok.decode(&ids).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_or_broken_tokenizer_names_the_file() {
        let dir = synth_dir("bad");
        std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
        let e = Tokenizer::from_dir(&dir).err().unwrap().to_string();
        assert!(
            e.contains("tokenizer.json") && e.contains("not found"),
            "{e}"
        );
        std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
        let e = Tokenizer::from_dir(&dir).err().unwrap().to_string();
        assert!(e.contains("tokenizer.json"), "{e}");
        // What the tokenizers crate panics on is refused first, with one line.
        let good = tokenizer_json(512);
        let mut broken = good.to_string();
        let decoder = broken.find(r#""decoder":{"#).unwrap() + 11;
        broken.insert_str(decoder, r#""x" 1,"#);
        let mut precompiled = good.clone();
        precompiled["normalizer"] = serde_json::json!({"type": "Sequence", "normalizers": [
            {"type": "Precompiled", "precompiled_charsmap": "AAAA"}]});
        let mut undefined = good.clone();
        undefined["post_processor"]["single"][0]["SpecialToken"]["id"] = "<|x|>".into();
        // The crate takes a template of the right shape whatever its type says.
        undefined["post_processor"]["type"] = "Te_plateProcessing".into();
        let mut strip = good.clone();
        strip["decoder"] = serde_json::json!({"type": "Sequence", "decoders": [
            {"type": "Strip", "content": " ", "start": 1, "stop": 1}]});
        for (json, what) in [
            (broken, "not valid JSON"),
            (precompiled.to_string(), "Precompiled"),
            (
                undefined.to_string(),
                "\"<|x|>\", which special_tokens does not define",
            ),
            (strip.to_string(), "Strip decoder"),
        ] {
            std::fs::write(dir.join("tokenizer.json"), json).unwrap();
            let e = Tokenizer::from_dir(&dir).err().unwrap().to_string();
            assert!(
                e.contains("tokenizer.json: cannot load") && e.contains(what),
                "{e}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// stories260k's tokenizer gives the reference's prompt ids, and its generated ids decode
    /// (at once, and streamed one by one) to the reference's text. The rank crate's test checks
    /// the ids themselves against the same reference.
    #[test]
    fn stories260k_tokenizer_matches_the_transformers_reference() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/models/stories260k");
        if !dir.join("tokenizer.json").exists() {
            println!("skipped: ../shared/models/stories260k not found");
            return;
        }
        let reference: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
        let ids = |k: &str| -> Vec<u32> {
            reference[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        let prompt = ids("prompt_token_ids");
        let tok = Tokenizer::from_dir(&dir).unwrap();
        assert_eq!(
            tok.encode(reference["prompt"].as_str().unwrap()).unwrap(),
            prompt
        );
        let all: Vec<u32> = prompt
            .iter()
            .chain(&ids("generated_token_ids"))
            .copied()
            .collect();
        let text = reference["text"].as_str().unwrap();
        assert_eq!(tok.decode(&all).unwrap(), text);
        let mut stream = TextStream::new();
        let mut streamed = String::new();
        for &t in &all {
            streamed.extend(stream.push(&tok, t).unwrap());
            assert!(
                stream.window_len() <= 2 * MAX_HELD,
                "{}",
                stream.window_len()
            );
        }
        assert_eq!(streamed, text);
        // Streamed after any cut of the prompt and generation, the pieces are what the ids
        // after the cut add to the text before it: at 4 ids ("Once upon a"), " time", with
        // the space that decoding "▁time" alone strips.
        for cut in 1..12 {
            let mut stream = TextStream::after(&all[..cut]);
            let mut streamed = String::new();
            for &t in &all[cut..] {
                streamed.extend(stream.push(&tok, t).unwrap());
            }
            let before = tok.decode(&all[..cut]).unwrap();
            assert_eq!(format!("{before}{streamed}"), text, "cut {cut}");
        }
        let mut stream = TextStream::after(&all[..4]);
        assert_eq!(stream.push(&tok, all[4]).unwrap().as_deref(), Some(" time"));
    }
}
