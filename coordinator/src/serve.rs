//! `tprun serve`: an OpenAI-compatible HTTP server in the coordinator over a `serve` job
//! (rank/src/serve.rs) that decodes its requests as a continuous batch.
//!
//! Three parts meet here. The HTTP side (axum on a small tokio runtime, its own thread)
//! validates each request into token ids and sampling settings and queues it (bounded: a full
//! queue is a 503). The engine is the job's [`Observer`]: on each supervision tick it sends
//! queued requests to every rank (`Msg::Work`) while fewer than `--max-batch` are with them;
//! rank 0 admits each into the batch at its next step (a free KV-cache slot is waiting for
//! it) and tells the other ranks through the control block. Rank 0's tokens arrive through
//! the control block's ring, tagged with their request, and go to that request's channel;
//! rank 0's `Report::Served` ends it. The handler turns tokens into text (incrementally,
//! honouring `stop` strings) and answers as JSON or as server-sent events.
//!
//! A request whose handler is gone (its client disconnected, or a stop string ended its text)
//! is cancelled: rank 0 hears of it and evicts it from the batch at its next step, freeing
//! its slot (`tprun_cancelled_total` counts them). `/metrics` reads rank 0's batch
//! statistics (steps, rows, current and peak batch size) from the control block.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tprun_ipc::{ControlBlock, Msg};
use tprun_kernels::ops::TOPK_MAX;
use tprun_rank::job::{self, GenRequest, Report, ServeSpec, Task, Work};

use crate::cli::ServeArgs;
use crate::decode::ModelInput;
use crate::launch::{JobError, Listen, Observer, RankConns};
use crate::tokenizer::{TextStream, Tokenizer};
use crate::{dtype_arg, Settings};

/// What a handler hears about its request.
enum Event {
    Token(u32),
    Done { stopped: bool },
}

/// A validated request waiting for the ranks.
struct Submit {
    req: GenRequest,
    events: UnboundedSender<Event>,
}

/// What the HTTP handlers share.
struct Shared {
    tok: Tokenizer,
    /// The id `/v1/models` lists and requests must name.
    model_id: String,
    /// KV-cache length: prompt + generated tokens must fit.
    context: usize,
    eos: Vec<u32>,
    /// tokenizer_config.json's chat template, with its BOS and EOS strings.
    chat: Option<ChatTemplate>,
    queue: SyncSender<Submit>,
    ready: AtomicBool,
    requests: AtomicU64,
    tokens: AtomicU64,
    queued: AtomicU64,
    /// Requests the ranks have (the batch, and those joining it at the next step).
    running: AtomicU64,
    /// Requests ended early because their client left or a stop string ended them.
    cancelled: AtomicU64,
    /// The job's control block, where rank 0 keeps its batch statistics.
    control: std::sync::OnceLock<Arc<ControlBlock>>,
    next_id: AtomicU64,
    /// From a request's arrival to its first token reaching the server.
    ttft: Histogram,
    /// Between consecutive tokens of one request.
    itl: Histogram,
}

struct ChatTemplate {
    source: String,
    bos: String,
    eos: String,
}

/// Requests that may wait for the ranks; one more is a 503.
const QUEUE: usize = 64;
/// Sequences decoding together unless --max-batch says otherwise.
pub const DEFAULT_MAX_BATCH: usize = 16;

/// Upper bounds (seconds) of the latency histograms' buckets (Prometheus `le`).
const BUCKETS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A Prometheus histogram of seconds, filled from any thread.
#[derive(Default)]
struct Histogram {
    /// Observations at or below each bound (not cumulative; summed when rendered).
    counts: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: std::time::Duration) {
        let secs = d.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|&b| secs <= b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    fn render(&self, name: &str, out: &mut String) {
        out.push_str(&format!("# TYPE {name} histogram\n"));
        let mut cum = 0;
        for (b, c) in BUCKETS.iter().zip(&self.counts) {
            cum += c.load(Ordering::Relaxed);
            out.push_str(&format!("{name}_bucket{{le=\"{b}\"}} {cum}\n"));
        }
        let count = self.count.load(Ordering::Relaxed);
        out.push_str(&format!("{name}_bucket{{le=\"+Inf\"}} {count}\n"));
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        out.push_str(&format!("{name}_sum {sum}\n{name}_count {count}\n"));
    }
}

pub fn run(settings: &Settings, args: &ServeArgs) -> Result<i32, JobError> {
    let usage = |m: String| JobError::Usage(m);
    let bad = |m: String| JobError::Setup(anyhow::anyhow!("{m}"));
    let dtype = dtype_arg("--dtype", &args.dtype, &["auto"]).map_err(usage)?;
    let kv_dtype = dtype_arg("--kv-dtype", &args.kv_dtype, &["auto"]).map_err(usage)?;
    let model = ModelInput::open(args.model.as_deref())?;
    // A DeltaNet layer's recurrent state holds one sequence: hybrids decode one at a time.
    let max_batch = match (args.max_batch, model.cfg.hybrid.is_some()) {
        (Some(b), true) if b > 1 => {
            return Err(usage(format!(
                "--max-batch {b}: {} is a hybrid (DeltaNet) model, whose recurrent state \
                 holds one sequence; it serves one request at a time (--max-batch 1)",
                model.name
            )))
        }
        (_, true) => 1,
        (b, false) => b.unwrap_or(DEFAULT_MAX_BATCH),
    };
    let (model_spec, context) = model.spec(
        dtype,
        kv_dtype,
        args.max_seq,
        args.graph == "on",
        settings,
        max_batch,
    )?;
    let chat = args
        .model
        .as_deref()
        .map(chat_template)
        .transpose()
        .map_err(bad)?
        .flatten();
    let listen = args.listen.as_ref().map(|p| join_point(p)).transpose()?;
    let listener = std::net::TcpListener::bind((args.host.as_str(), args.port))
        .map_err(|e| bad(format!("cannot listen on {}:{}: {e}", args.host, args.port)))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| bad(format!("listening socket: {e}")))?;
    let addr = listener
        .local_addr()
        .map_err(|e| bad(format!("listening socket: {e}")))?;
    let model_id = match &args.model {
        Some(dir) => dir
            .file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned()),
        None => "tprun-default".into(),
    };
    let (queue, rx) = std::sync::mpsc::sync_channel(QUEUE);
    let shared = Arc::new(Shared {
        tok: model.tok,
        model_id: model_id.clone(),
        context,
        eos: model.cfg.eos.clone(),
        chat,
        queue,
        ready: AtomicBool::new(false),
        requests: AtomicU64::new(0),
        tokens: AtomicU64::new(0),
        queued: AtomicU64::new(0),
        running: AtomicU64::new(0),
        cancelled: AtomicU64::new(0),
        control: std::sync::OnceLock::new(),
        next_id: AtomicU64::new(1),
        ttft: Histogram::default(),
        itl: Histogram::default(),
    });
    let http =
        http_thread(listener, shared.clone()).map_err(|e| bad(format!("HTTP server: {e}")))?;
    eprintln!(
        "tprun serve: {} rank(s), backend {}; model {model_id} ({}); listening on http://{addr}",
        settings.world,
        settings.backend.name(),
        model.name
    );
    if let Some(l) = &listen {
        let told = std::env::var_os("TPRUN_JOB_TOKEN").is_some();
        eprintln!(
            "tprun serve: waiting for {} rank(s) to join at {}: start each with `tprun rank \
             --join {} --rank I [--device D]` and the job token in TPRUN_JOB_TOKEN{}",
            settings.world,
            l.path.display(),
            l.path.display(),
            if told {
                " (ours)".to_string()
            } else {
                format!(" ({})", crate::launch::hex(&l.token))
            }
        );
    }
    let spec = ServeSpec {
        model: model_spec,
        max_batch,
    };
    let mut engine = Engine {
        shared,
        rx,
        running: BTreeMap::new(),
        max_batch,
        stopping: false,
    };
    let mut launch = settings.launch(Task::Serve(spec));
    launch.listen = listen;
    let result = crate::launch::run(launch, &mut engine);
    // Closing the engine's channels tells every request still waiting that the ranks are
    // gone (a 503, or an error event on a stream); then the HTTP server stops taking
    // connections and finishes the answers it is writing (the last request's included), for
    // at most a few seconds.
    engine.shared.ready.store(false, Ordering::SeqCst);
    drop(engine);
    http.finish(std::time::Duration::from_secs(5));
    result?;
    eprintln!("tprun serve: stopped");
    Ok(0)
}

/// Where `--listen` ranks join, and their token: TPRUN_JOB_TOKEN's when set (an orchestrator
/// hands the same one to the ranks), else a fresh one that we print.
fn join_point(path: &Path) -> Result<Listen, JobError> {
    if path.symlink_metadata().is_ok() {
        return Err(JobError::Setup(anyhow::anyhow!(
            "{} exists already (another job's socket, or one left by a job that was killed): \
             remove it, or listen at another path",
            path.display()
        )));
    }
    let token = match std::env::var("TPRUN_JOB_TOKEN") {
        Ok(t) => tprun_rank::run::parse_token(&t).ok_or_else(|| {
            JobError::Usage("TPRUN_JOB_TOKEN is set but is not 32 hex digits".into())
        })?,
        Err(_) => crate::launch::random_token()
            .map_err(|e| anyhow::anyhow!("reading /dev/urandom: {e}"))?,
    };
    Ok(Listen {
        path: path.to_path_buf(),
        token,
    })
}

/// tokenizer_config.json's `chat_template` (a string; `None` when the file or the key is
/// absent, or the template is a list of named ones), with its BOS and EOS token strings.
fn chat_template(dir: &Path) -> Result<Option<ChatTemplate>, String> {
    let path = dir.join("tokenizer_config.json");
    if !path.exists() {
        return Ok(None);
    }
    let text =
        tprun_rank::files::read_json_text(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let token = |k: &str| match &v[k] {
        Value::String(s) => s.clone(),
        Value::Object(o) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or("")
            .into(),
        _ => String::new(),
    };
    Ok(v["chat_template"].as_str().map(|s| ChatTemplate {
        source: s.to_string(),
        bos: token("bos_token"),
        eos: token("eos_token"),
    }))
}

/// The HTTP server's thread: told to stop by `stop`, says it has on `ended`.
struct Http {
    stop: tokio::sync::oneshot::Sender<()>,
    ended: Receiver<()>,
}

impl Http {
    /// Stops taking connections and waits (at most `within`) for the open ones to finish.
    fn finish(self, within: std::time::Duration) {
        let _ = self.stop.send(());
        if self.ended.recv_timeout(within).is_err() {
            eprintln!("tprun serve: HTTP connections still open after {within:?}; leaving them");
        }
    }
}

fn http_thread(listener: std::net::TcpListener, shared: Arc<Shared>) -> std::io::Result<Http> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let app = Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .fallback(not_found)
        .with_state(shared);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (ended_tx, ended) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("tprun-http".into())
        .spawn(move || {
            rt.block_on(async move {
                match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => {
                        let quit = async {
                            let _ = stopped.await;
                        };
                        if let Err(e) = axum::serve(l, app).with_graceful_shutdown(quit).await {
                            eprintln!("tprun serve: HTTP server stopped: {e}");
                        }
                    }
                    Err(e) => eprintln!("tprun serve: listening socket: {e}"),
                }
            });
            let _ = ended_tx.send(());
        })?;
    Ok(Http { stop, ended })
}

// ---- the engine (the job's observer) -----------------------------------------------------

struct Engine {
    shared: Arc<Shared>,
    rx: Receiver<Submit>,
    /// Requests sent to the ranks and not yet served (at most `max_batch`: rank 0 admits
    /// each into the batch at its next step), by id.
    running: BTreeMap<u64, Running>,
    max_batch: usize,
    /// Ctrl-C: the ranks were told to finish; nothing new is sent.
    stopping: bool,
}

/// A request the ranks have: where its tokens go.
struct Running {
    events: UnboundedSender<Event>,
    /// Its early end has been asked for (its handler is gone).
    cancelling: bool,
}

impl Observer for Engine {
    fn attach(&mut self, control: &Arc<ControlBlock>) {
        let _ = self.shared.control.set(control.clone());
    }

    fn report(&mut self, _rank: usize, report: Report) {
        match report {
            Report::Loaded { seconds, .. } => {
                eprintln!("tprun serve: weights loaded in {seconds:.1} s")
            }
            Report::Ready => {
                self.shared.ready.store(true, Ordering::SeqCst);
                eprintln!("tprun serve: ready");
            }
            Report::Served { id, stopped, .. } => {
                if let Some(r) = self.running.remove(&id) {
                    if r.cancelling {
                        self.shared.cancelled.fetch_add(1, Ordering::Relaxed);
                    }
                    let _ = r.events.send(Event::Done { stopped });
                }
                self.shared
                    .running
                    .store(self.running.len() as u64, Ordering::Relaxed);
            }
            _ => {}
        }
    }

    fn tokens(&mut self, tokens: &[(u32, u32)]) {
        self.shared
            .tokens
            .fetch_add(tokens.len() as u64, Ordering::Relaxed);
        for &(tag, t) in tokens {
            // The tag is the id's low half (unique among the few in flight).
            if let Some(r) = self.running.iter().find(|(&id, _)| id as u32 == tag) {
                // A handler that is gone (client disconnected, stop string met) drops them.
                let _ = r.1.events.send(Event::Token(t));
            }
        }
    }

    fn stop(&mut self, ranks: &RankConns<'_>) -> bool {
        // Until rank 0 reports Ready it is still setting up or loading, and reads no work
        // message (a Shutdown then broke its setup: "expected Peers"): nothing runs yet, so
        // the job is aborted, as decode's is (exit 130).
        if !self.shared.ready.load(Ordering::SeqCst) {
            return false;
        }
        eprintln!("tprun serve: stopping (after the running requests; Ctrl-C again to abort)");
        self.stopping = true;
        self.shared.ready.store(false, Ordering::SeqCst);
        // Rank 0 alone decides when the batch changes (the others follow its step plans): it
        // alone hears of cancels and the shutdown, which is the last message it gets. A rank
        // must exit with nothing unread on its socket (a socket closed with unread data
        // resets the connection, and its last message, `Done`, could be lost).
        ranks
            .send_to(
                0,
                &Msg::Work {
                    payload: job::encode(&Work::Shutdown),
                },
            )
            .is_ok()
    }

    /// Tokens reach their clients within a quarter of a millisecond (the default 5 ms tick
    /// made every inter-token gap either ~0 or a whole tick).
    fn tick_interval(&self) -> std::time::Duration {
        std::time::Duration::from_micros(250)
    }

    fn tick(&mut self, ranks: &RankConns<'_>) -> anyhow::Result<()> {
        if self.stopping {
            // Queued requests will not run: their handlers see their channels close.
            while self.rx.try_recv().is_ok() {
                self.shared.queued.fetch_sub(1, Ordering::Relaxed);
            }
            return Ok(());
        }
        // A request whose handler is gone (client disconnected, or a stop string ended its
        // text): rank 0 evicts it from the batch at its next step, freeing its slot.
        for (&id, r) in self.running.iter_mut() {
            if r.events.is_closed() && !r.cancelling {
                let payload = job::encode(&Work::Cancel(id));
                ranks.send_to(0, &Msg::Work { payload })?;
                r.cancelling = true;
            }
        }
        if !self.shared.ready.load(Ordering::SeqCst) {
            return Ok(());
        }
        while self.running.len() < self.max_batch {
            let Ok(next) = self.rx.try_recv() else {
                break;
            };
            self.shared.queued.fetch_sub(1, Ordering::Relaxed);
            if next.events.is_closed() {
                continue; // its client left while it waited
            }
            let payload = job::encode(&Work::Generate(next.req.clone()));
            ranks.send_all(&Msg::Work { payload })?;
            let r = Running {
                events: next.events,
                cancelling: false,
            };
            self.running.insert(next.req.id, r);
        }
        self.shared
            .running
            .store(self.running.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}

// ---- HTTP handlers -----------------------------------------------------------------------

/// An OpenAI-style error answer: `{"error": {message, type, param, code}}` with its status.
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    param: Option<String>,
    code: Option<&'static str>,
    message: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind,
                                    "param": self.param, "code": self.code}});
        (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response()
    }
}

fn error(
    status: StatusCode,
    kind: &'static str,
    param: Option<&str>,
    code: Option<&'static str>,
    message: String,
) -> Response {
    ApiError {
        status,
        kind,
        param: param.map(str::to_string),
        code,
        message,
    }
    .into_response()
}

/// A 400 about `param`.
fn invalid(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError {
        status: StatusCode::BAD_REQUEST,
        kind: "invalid_request_error",
        param: Some(param.to_string()),
        code: None,
        message: msg.into(),
    }
}

fn json_response(v: Value) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

async fn not_found() -> Response {
    error(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        None,
        Some("not_found"),
        "no such route (this server has /v1/completions, /v1/chat/completions, /v1/models, \
         /health, /metrics)"
            .into(),
    )
}

async fn health(State(s): State<Arc<Shared>>) -> Response {
    if s.ready.load(Ordering::SeqCst) {
        json_response(json!({"status": "ok"}))
    } else {
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            None,
            Some("loading"),
            "the model is still loading".into(),
        )
    }
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    let batch = s.control.get().map(|c| c.batch_stats()).unwrap_or_default();
    let mut text = format!(
        "# TYPE tprun_requests_total counter\ntprun_requests_total {}\n\
         # TYPE tprun_generated_tokens_total counter\ntprun_generated_tokens_total {}\n\
         # TYPE tprun_queue_depth gauge\ntprun_queue_depth {}\n\
         # TYPE tprun_requests_running gauge\ntprun_requests_running {}\n\
         # TYPE tprun_batch_size gauge\ntprun_batch_size {}\n\
         # TYPE tprun_batch_size_peak gauge\ntprun_batch_size_peak {}\n\
         # TYPE tprun_decode_steps_total counter\ntprun_decode_steps_total {}\n\
         # TYPE tprun_decode_rows_total counter\ntprun_decode_rows_total {}\n\
         # TYPE tprun_cancelled_total counter\ntprun_cancelled_total {}\n\
         # TYPE tprun_ready gauge\ntprun_ready {}\n",
        s.requests.load(Ordering::Relaxed),
        s.tokens.load(Ordering::Relaxed),
        s.queued.load(Ordering::Relaxed),
        s.running.load(Ordering::Relaxed),
        batch.size,
        batch.peak,
        batch.steps,
        batch.rows,
        s.cancelled.load(Ordering::Relaxed),
        u8::from(s.ready.load(Ordering::SeqCst)),
    );
    s.ttft
        .render("tprun_time_to_first_token_seconds", &mut text);
    s.itl.render("tprun_inter_token_latency_seconds", &mut text);
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        text,
    )
        .into_response()
}

async fn models(State(s): State<Arc<Shared>>) -> Response {
    json_response(json!({
        "object": "list",
        "data": [{"id": s.model_id, "object": "model", "created": now(), "owned_by": "tprun"}],
    }))
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The settings both endpoints share, checked.
struct Sampling {
    max_tokens: usize,
    temperature: f32,
    top_p: f32,
    top_k: usize,
    seed: u64,
    stop: Vec<String>,
    stream: bool,
    /// Generate past the model's end-of-sequence ids (vLLM's extension; for benchmarks).
    ignore_eos: bool,
}

/// Parses the JSON body and the fields both endpoints take; `Err` is the answer to send.
/// `max_tokens` defaults as OpenAI's do: 16 for a completion, the context's room for chat
/// (where `max_completion_tokens` is its newer name).
fn parse_common(s: &Shared, body: &Bytes, kind: Kind) -> Result<(Value, Sampling), ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| invalid("body", format!("the body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(invalid("body", "the body must be a JSON object"));
    }
    match v.get("model") {
        None => return Err(invalid("model", "missing field `model`")),
        Some(Value::String(m)) if *m == s.model_id => {}
        Some(Value::String(m)) => {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                kind: "invalid_request_error",
                param: Some("model".into()),
                code: Some("model_not_found"),
                message: format!(
                    "the model `{m}` does not exist (this server has `{}`)",
                    s.model_id
                ),
            })
        }
        Some(_) => return Err(invalid("model", "`model` must be a string")),
    }
    let num = |k: &str, default: f64, lo: f64, hi: f64| -> Result<f64, ApiError> {
        match v.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Number(n)) => {
                let x = n.as_f64().unwrap_or(f64::NAN);
                if x >= lo && x <= hi {
                    Ok(x)
                } else {
                    Err(invalid(
                        k,
                        format!("`{k}` must be in [{lo}, {hi}] (got {x})"),
                    ))
                }
            }
            Some(_) => Err(invalid(k, format!("`{k}` must be a number"))),
        }
    };
    let whole = |k: &str, default: u64, hi: u64| -> Result<u64, ApiError> {
        match v.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Number(n)) => n.as_u64().filter(|&x| x <= hi).ok_or_else(|| {
                invalid(
                    k,
                    format!("`{k}` must be a whole number in [0, {hi}] (got {n})"),
                )
            }),
            Some(_) => Err(invalid(k, format!("`{k}` must be a whole number"))),
        }
    };
    if whole("n", 1, u64::MAX)? != 1 {
        return Err(invalid("n", "only `n` = 1 is supported"));
    }
    let stop = match v.get("stop") {
        None | Some(Value::Null) => vec![],
        Some(Value::String(t)) => vec![t.clone()],
        Some(Value::Array(a)) if a.len() <= 4 => a
            .iter()
            .map(|x| x.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| invalid("stop", "`stop` must be a string or a list of strings"))?,
        Some(_) => {
            return Err(invalid(
                "stop",
                "`stop` must be a string or up to 4 strings",
            ))
        }
    };
    if stop.iter().any(String::is_empty) {
        return Err(invalid("stop", "a `stop` string may not be empty"));
    }
    let flag = |k: &str| match v.get(k) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(invalid(k, format!("`{k}` must be true or false"))),
    };
    let (stream, ignore_eos) = (flag("stream")?, flag("ignore_eos")?);
    let max_tokens = match kind {
        Kind::Text => whole("max_tokens", 16, u32::MAX as u64)?,
        Kind::Chat if v.get("max_completion_tokens").is_some_and(|x| !x.is_null()) => {
            whole("max_completion_tokens", 0, u32::MAX as u64)?
        }
        Kind::Chat => whole("max_tokens", u32::MAX as u64, u32::MAX as u64)?,
    };
    // No seed: a different draw per request, as OpenAI's.
    let fresh_seed = s
        .next_id
        .load(Ordering::Relaxed)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    let sampling = Sampling {
        max_tokens: max_tokens as usize,
        temperature: num("temperature", 1.0, 0.0, 2.0)? as f32,
        // top_p 0 would keep nothing: the sampler takes (0, 1].
        top_p: num("top_p", 1.0, 1e-9, 1.0)? as f32,
        top_k: whole("top_k", 0, TOPK_MAX as u64)? as usize,
        seed: whole("seed", fresh_seed, u64::MAX)?,
        stop,
        stream,
        ignore_eos,
    };
    Ok((v, sampling))
}

async fn completions(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    let (v, sampling) = match parse_common(&s, &body, Kind::Text) {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let prompt = match v.get("prompt") {
        None => return invalid("prompt", "missing field `prompt`").into_response(),
        Some(Value::String(p)) => p.clone(),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            a[0].as_str().unwrap_or_default().to_string()
        }
        Some(_) => {
            return invalid("prompt", "`prompt` must be a string (or a list of one)")
                .into_response()
        }
    };
    let ids = match s.tok.encode(&prompt) {
        Ok(ids) => ids,
        Err(e) => return invalid("prompt", e.to_string()).into_response(),
    };
    generate(s, ids, sampling, Kind::Text).await
}

async fn chat_completions(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    let (v, sampling) = match parse_common(&s, &body, Kind::Chat) {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let Some(msgs) = v.get("messages") else {
        return invalid("messages", "missing field `messages`").into_response();
    };
    let Some(list) = msgs.as_array().filter(|a| !a.is_empty()) else {
        return invalid("messages", "`messages` must be a non-empty list").into_response();
    };
    for m in list {
        if !(m["role"].is_string() && m["content"].is_string()) {
            return invalid(
                "messages",
                "each message needs a string `role` and a string `content`",
            )
            .into_response();
        }
    }
    let ids = match render_chat(&s, msgs) {
        Ok(ids) => ids,
        Err(e) => return invalid("messages", e).into_response(),
    };
    generate(s, ids, sampling, Kind::Chat).await
}

/// The conversation as prompt ids: through tokenizer_config.json's template (which writes its
/// own special tokens), else "role: content" lines and "assistant:".
fn render_chat(s: &Shared, msgs: &Value) -> Result<Vec<u32>, String> {
    match &s.chat {
        Some(t) => {
            let text = render_template(t, msgs)?;
            s.tok.encode_plain(&text).map_err(|e| e.to_string())
        }
        None => {
            let mut text = String::new();
            for m in msgs.as_array().into_iter().flatten() {
                text.push_str(&format!(
                    "{}: {}\n",
                    m["role"].as_str().unwrap_or_default(),
                    m["content"].as_str().unwrap_or_default()
                ));
            }
            text.push_str("assistant:");
            s.tok.encode(&text).map_err(|e| e.to_string())
        }
    }
}

/// Template instructions one chat render may run: real templates take a few thousand per
/// message, and a template that loops (for ever, or 10^10 times) stops within a second with an
/// error instead of holding a worker thread.
const TEMPLATE_FUEL: u64 = 5_000_000;

/// The chat template `t` rendered over `msgs`, with the generation prompt.
fn render_template(t: &ChatTemplate, msgs: &Value) -> Result<String, String> {
    let mut env = minijinja::Environment::new();
    env.set_fuel(Some(TEMPLATE_FUEL));
    env.add_function(
        "raise_exception",
        |m: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                m,
            ))
        },
    );
    env.add_template("chat", &t.source)
        .map_err(|e| format!("the model's chat template: {e}"))?;
    env.get_template("chat")
        .and_then(|tpl| {
            tpl.render(minijinja::context! {
                messages => msgs,
                add_generation_prompt => true,
                bos_token => t.bos.as_str(),
                eos_token => t.eos.as_str(),
            })
        })
        .map_err(|e| match e.kind() {
            minijinja::ErrorKind::OutOfFuel => format!(
                "the model's chat template ran over {TEMPLATE_FUEL} instructions (a loop that \
                 does not end?)"
            ),
            _ => format!("the model's chat template: {e}"),
        })
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Text,
    Chat,
}

/// Text with `stop` strings honoured: what may be sent so far, and whether a stop string
/// ended it. A piece that could begin a stop string is held back until it cannot.
struct StopText {
    text: String,
    sent: usize,
    stop: Vec<String>,
    hold: usize,
}

impl StopText {
    fn new(stop: Vec<String>) -> StopText {
        let hold = stop.iter().map(|t| t.len()).max().unwrap_or(1) - 1;
        StopText {
            text: String::new(),
            sent: 0,
            stop,
            hold,
        }
    }

    /// Adds `piece`; returns the text now safe to send, and true when a stop string was met
    /// (the text ends before it).
    fn push(&mut self, piece: &str) -> (String, bool) {
        self.text.push_str(piece);
        // A stop string may have begun in the held-back text, never before it.
        let mut from = self.sent.saturating_sub(self.hold);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let found = self
            .stop
            .iter()
            .filter_map(|t| self.text[from..].find(t.as_str()))
            .map(|i| i + from)
            .min();
        if let Some(at) = found {
            self.text.truncate(at);
            let out = self.text[self.sent.min(at)..].to_string();
            self.sent = at;
            return (out, true);
        }
        let mut end = self.text.len().saturating_sub(self.hold).max(self.sent);
        while !self.text.is_char_boundary(end) {
            end -= 1;
        }
        let out = self.text[self.sent..end].to_string();
        self.sent = end;
        (out, false)
    }

    /// The rest, at the end of generation.
    fn finish(&mut self) -> String {
        let out = self.text[self.sent..].to_string();
        self.sent = self.text.len();
        out
    }
}

async fn generate(s: Arc<Shared>, ids: Vec<u32>, sp: Sampling, kind: Kind) -> Response {
    let arrived = std::time::Instant::now();
    if ids.is_empty() {
        return invalid("prompt", "the prompt encodes to no tokens").into_response();
    }
    if ids.len() >= s.context {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("prompt"),
            Some("context_length_exceeded"),
            format!(
                "the prompt is {} tokens; this server's context holds {} (prompt + completion)",
                ids.len(),
                s.context
            ),
        );
    }
    let id = s.next_id.fetch_add(1, Ordering::Relaxed);
    let prompt_len = ids.len();
    // The completion's text continues the prompt's (a leading space kept).
    let text = TextStream::after(&ids);
    let (tx, rx) = unbounded_channel();
    let budget = sp.max_tokens.min(s.context - ids.len());
    let req = GenRequest {
        id,
        prompt: ids,
        max_new_tokens: budget,
        stop: if sp.ignore_eos {
            Vec::new()
        } else {
            s.eos.clone()
        },
        temperature: sp.temperature,
        top_k: sp.top_k,
        top_p: sp.top_p,
        seed: sp.seed,
    };
    // The request travels to every rank in one frame.
    let frame = job::encode(&Work::Generate(req.clone())).len();
    if frame + 64 > tprun_ipc::wire::MAX_FRAME {
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            Some("prompt"),
            Some("prompt_too_large"),
            format!(
                "the prompt is {} tokens: {frame} bytes for the ranks, over the {} a message \
                 may carry",
                req.prompt.len(),
                tprun_ipc::wire::MAX_FRAME
            ),
        );
    }
    s.queued.fetch_add(1, Ordering::Relaxed);
    match s.queue.try_send(Submit { req, events: tx }) {
        Ok(()) => {}
        Err(e) => {
            s.queued.fetch_sub(1, Ordering::Relaxed);
            let why = match e {
                TrySendError::Full(_) => "the request queue is full; try again later",
                TrySendError::Disconnected(_) => "the server is shutting down",
            };
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                None,
                Some("overloaded"),
                why.into(),
            );
        }
    }
    s.requests.fetch_add(1, Ordering::Relaxed);
    let head = Head {
        id: format!(
            "{}-{id}",
            if kind == Kind::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            }
        ),
        created: now(),
        model: s.model_id.clone(),
        kind,
    };
    let gen = Gen {
        s,
        rx,
        prompt_len,
        last: arrived,
        text,
        stop: StopText::new(sp.stop),
        generated: 0,
    };
    if sp.stream {
        stream_response(head, gen)
    } else {
        whole_response(head, gen).await
    }
}

/// The fields every answer and chunk repeats.
struct Head {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
}

/// A running generation as the handler sees it.
struct Gen {
    s: Arc<Shared>,
    rx: UnboundedReceiver<Event>,
    prompt_len: usize,
    /// When the request arrived, then when its last token did.
    last: std::time::Instant,
    text: TextStream,
    stop: StopText,
    generated: usize,
}

/// What one await on [`Gen::next`] gives.
enum Step {
    /// New text (possibly empty).
    Text(String),
    /// The end: the last text and the finish reason.
    End(String, &'static str),
    /// The job ended under the request.
    Lost,
}

impl Gen {
    async fn next(&mut self) -> Step {
        match self.rx.recv().await {
            Some(Event::Token(t)) => {
                let now = std::time::Instant::now();
                let h = if self.generated == 0 {
                    &self.s.ttft
                } else {
                    &self.s.itl
                };
                h.observe(now - self.last);
                self.last = now;
                self.generated += 1;
                let piece = self
                    .text
                    .push(&self.s.tok, t)
                    .ok()
                    .flatten()
                    .unwrap_or_default();
                let (out, stopped) = self.stop.push(&piece);
                if stopped {
                    // Closing the channel makes the engine cancel the rest on the ranks.
                    self.rx.close();
                    return Step::End(out, "stop");
                }
                Step::Text(out)
            }
            Some(Event::Done { stopped }) => {
                let rest = self.stop.finish();
                Step::End(rest, if stopped { "stop" } else { "length" })
            }
            None => Step::Lost,
        }
    }
}

fn usage_json(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

async fn whole_response(head: Head, mut g: Gen) -> Response {
    let mut text = String::new();
    let reason = loop {
        match g.next().await {
            Step::Text(t) => text.push_str(&t),
            Step::End(t, reason) => {
                text.push_str(&t);
                break reason;
            }
            Step::Lost => {
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_error",
                    None,
                    Some("job_ended"),
                    "the ranks stopped before this request finished".into(),
                )
            }
        }
    };
    let choice = match head.kind {
        Kind::Text => {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": reason})
        }
        Kind::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": reason,
        }),
    };
    json_response(json!({
        "id": head.id,
        "object": if head.kind == Kind::Chat { "chat.completion" } else { "text_completion" },
        "created": head.created,
        "model": head.model,
        "choices": [choice],
        "usage": usage_json(g.prompt_len, g.generated),
    }))
}

fn chunk(head: &Head, text: Option<&str>, reason: Option<&str>, first: bool) -> String {
    let choice = match head.kind {
        Kind::Text => json!({
            "index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": reason,
        }),
        Kind::Chat => {
            let mut delta = json!({});
            if first {
                delta["role"] = json!("assistant");
            }
            if let Some(t) = text {
                delta["content"] = json!(t);
            }
            json!({"index": 0, "delta": delta, "finish_reason": reason})
        }
    };
    let v = json!({
        "id": head.id,
        "object": if head.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
        "created": head.created,
        "model": head.model,
        "choices": [choice],
    });
    format!("data: {v}\n\n")
}

fn stream_response(head: Head, g: Gen) -> Response {
    // (head, generation, chunks sent, finished)
    let state = (head, g, 0usize, false);
    let stream = futures_util::stream::unfold(state, |(head, mut g, n, done)| async move {
        if done {
            return None;
        }
        loop {
            let out = match g.next().await {
                Step::Text(t) if t.is_empty() => continue,
                Step::Text(t) => chunk(&head, Some(&t), None, n == 0),
                Step::End(t, reason) => {
                    let mut out = String::new();
                    if !t.is_empty() {
                        out.push_str(&chunk(&head, Some(&t), None, n == 0));
                    }
                    out.push_str(&chunk(&head, None, Some(reason), n == 0 && t.is_empty()));
                    out.push_str("data: [DONE]\n\n");
                    return Some((Ok::<_, std::io::Error>(out), (head, g, n + 1, true)));
                }
                Step::Lost => {
                    let e = json!({"error": {"message": "the ranks stopped before this request \
                        finished", "type": "server_error", "param": null, "code": "job_ended"}});
                    return Some((Ok(format!("data: {e}\n\n")), (head, g, n + 1, true)));
                }
            };
            return Some((Ok(out), (head, g, n + 1, false)));
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chat_template_that_never_ends_is_stopped() {
        let t = |source: &str| ChatTemplate {
            source: source.into(),
            bos: "<s>".into(),
            eos: "</s>".into(),
        };
        let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
        let ok = t(
            "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n\
                    {% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
        );
        assert_eq!(
            render_template(&ok, &msgs).unwrap(),
            "<s>user: hi\nassistant:"
        );
        // 10^7 steps: over the fuel, so an error with it; without it, text (the test fails).
        let endless = t("{% for i in range(100000) %}{% for j in range(100) %}x\
                         {% endfor %}{% endfor %}");
        let err = render_template(&endless, &msgs).unwrap_err();
        assert!(err.contains("ran over 5000000 instructions"), "{err}");
    }

    #[test]
    fn stop_strings_cut_the_text_even_across_pieces() {
        let mut s = StopText::new(vec!["END".into(), "\n\n".into()]);
        let (a, stop) = s.push("hello E");
        assert!(!stop);
        // "E" may begin "END": held back.
        assert_eq!(a, "hello");
        let (b, stop) = s.push("ND and more");
        assert!(stop);
        assert_eq!(format!("{a}{b}"), "hello ");
        let mut s = StopText::new(vec![]);
        assert_eq!(s.push("abc"), ("abc".into(), false));
        assert_eq!(s.finish(), "");
        let mut s = StopText::new(vec!["xyz".into()]);
        let (a, _) = s.push("héé");
        assert_eq!(format!("{a}{}", s.finish()), "héé");
    }
}
