//! Starting and supervising a job: the rendezvous socket, spawning ranks pinned to
//! their devices, admitting them, exchanging their buffer exports, and watching them until the
//! end. Nothing outlives the job, however the coordinator dies: the rendezvous socket has an
//! abstract name (no file; it vanishes with the listening socket, and stops accepting once
//! every rank has joined), shared memory is memfds, ranks die with the coordinator
//! (PDEATHSIG), and a failed job's ranks are stopped with SIGTERM, then SIGKILL.
//!
//! A job may instead wait for ranks started elsewhere ([`Listen`], `serve --listen`): in other
//! containers or namespaces, joining at a socket path with the job token. Those ranks are
//! not our children: the control block's abort is how we stop them, and a dropped connection
//! is how we learn that one died.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;
use tprun_ipc::control::describe_abort;
use tprun_ipc::wire::{Listener, Msg};
use tprun_ipc::{AbortReason, Conn, ControlBlock};
use tprun_rank::job::{self, JobSpec, Plan, Report};
use tprun_rank::{FailKind, Failure, Phase};

/// How long a connecting client has to say Hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Between SIGTERM and SIGKILL when stopping the ranks of a failed job.
const KILL_GRACE: Duration = Duration::from_millis(500);
/// How long after a rank's exit its connection may take to report closed.
const CLOSE_GRACE: Duration = Duration::from_millis(500);
/// The supervisor's tick: how often it looks at the token ring, heartbeats and signals.
const TICK: Duration = Duration::from_millis(5);
/// How often a `--listen` job that is still missing ranks names them.
const LISTEN_REMINDER: Duration = Duration::from_secs(30);

/// Set by SIGINT/SIGTERM handlers; the supervisor then aborts the job and cleans up.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// What went wrong with a job, with the exit code it maps to.
#[derive(Debug)]
pub enum JobError {
    /// A rank exited or died without finishing (exit 3).
    RankDied(String),
    /// A rank reported an error of this kind (exit 1; a rank's timeout is `Timeout`).
    RankError(FailKind, String),
    /// A wait ran past --timeout (exit 4).
    Timeout(String),
    /// The user interrupted the job (exit 130).
    Interrupted,
    /// The coordinator itself could not set the job up (exit 1).
    Setup(anyhow::Error),
    /// Bad flags or arguments (exit 2).
    Usage(String),
}

impl JobError {
    pub fn exit_code(&self) -> i32 {
        match self {
            JobError::RankDied(_) => 3,
            JobError::Timeout(_) => 4,
            JobError::Interrupted => 130,
            JobError::RankError(..) | JobError::Setup(_) => 1,
            JobError::Usage(_) => 2,
        }
    }

    /// What a rank's reported failure makes of the job, and the abort reason its peers see:
    /// the kind, not the message, decides.
    fn from_failure(kind: FailKind, text: String) -> (JobError, AbortReason) {
        match kind {
            FailKind::Timeout => (JobError::Timeout(text), AbortReason::Timeout),
            k => (JobError::RankError(k, text), AbortReason::RankFailed),
        }
    }

    /// A line of advice printed after the error, where there is one.
    pub fn hint(&self) -> Option<&'static str> {
        match self {
            JobError::Usage(_) => Some("see tprun --help"),
            JobError::Timeout(_) => Some(
                "a rank stopped making progress (its phase is named above); if the work is \
                 only slow, raise --timeout",
            ),
            JobError::RankError(FailKind::Device, _) => {
                Some("`tprun info` lists the devices; `tprun selftest` checks the kernels on them")
            }
            JobError::RankError(FailKind::Input, _) => Some(
                "check the model folder and the decode flags (`tprun synth` writes a folder \
                 known to load)",
            ),
            _ => None,
        }
    }
}

impl std::fmt::Display for JobError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobError::RankDied(m)
            | JobError::RankError(_, m)
            | JobError::Timeout(m)
            | JobError::Usage(m) => f.write_str(m),
            JobError::Interrupted => f.write_str("interrupted"),
            JobError::Setup(e) => write!(f, "{e:#}"),
        }
    }
}

impl From<anyhow::Error> for JobError {
    fn from(e: anyhow::Error) -> Self {
        JobError::Setup(e)
    }
}

/// Everything needed to start a job.
pub struct Launch {
    pub world: usize,
    /// Device of each rank.
    pub devices: Vec<usize>,
    pub timeout: Duration,
    pub spec: JobSpec,
    /// Wait for ranks started elsewhere to join here instead of spawning them.
    pub listen: Option<Listen>,
}

/// Where ranks started elsewhere join a job, and the token they must show.
pub struct Listen {
    /// A filesystem path for the rendezvous socket; it must not exist yet, and it is removed
    /// once every rank has joined (or the job ends first).
    pub path: PathBuf,
    pub token: [u8; 16],
}

/// Callbacks the command gets while the job runs.
pub trait Observer {
    /// The job's control block, once it exists (before any rank starts): for an observer
    /// that reads the ranks' statistics there at any time (`serve`'s metrics).
    fn attach(&mut self, _control: &Arc<ControlBlock>) {}
    fn report(&mut self, rank: usize, report: Report);
    /// Tokens rank 0 published, in order, each with its sequence's tag (serve: the request
    /// id's low 32 bits; 0 for decode's one sequence).
    fn tokens(&mut self, _tokens: &[(u32, u32)]) {}
    /// Every supervision tick (5 ms) once every rank has joined, after that tick's tokens and
    /// reports: where a job that takes work (`serve`) sends it to the ranks. An error ends
    /// the job (exit 1).
    fn tick(&mut self, _ranks: &RankConns<'_>) -> anyhow::Result<()> {
        Ok(())
    }
    /// The first Ctrl-C (SIGINT/SIGTERM) once every rank has joined: true when the observer
    /// has asked the ranks to finish (`serve`: a shutdown after the running request), so the
    /// job may end on its own; false (the default) aborts it. A second signal always aborts.
    fn stop(&mut self, _ranks: &RankConns<'_>) -> bool {
        false
    }
    /// How often the supervisor wakes with nothing to handle: it then drains the token ring
    /// and calls [`Observer::tick`]. A server wants tokens sooner than a terminal does.
    fn tick_interval(&self) -> Duration {
        TICK
    }
}

/// The connections of a job's ranks, for [`Observer::tick`].
pub struct RankConns<'a> {
    conns: Vec<&'a Conn>,
}

impl RankConns<'_> {
    /// Sends `msg` to every rank, in rank order.
    pub fn send_all(&self, msg: &Msg) -> anyhow::Result<()> {
        (0..self.conns.len()).try_for_each(|r| self.send_to(r, msg))
    }

    /// Sends `msg` to rank `r`.
    pub fn send_to(&self, r: usize, msg: &Msg) -> anyhow::Result<()> {
        self.conns[r]
            .send(msg, &[])
            .map_err(|e| anyhow::anyhow!("sending work to rank {r}: {e}"))
    }
}

enum Event {
    /// Rank r's connection, and its pid as the kernel saw it (0 if unknown).
    Joined(usize, Arc<Conn>, u32),
    /// A message from rank r on connection `id` (the address of its `Conn`).
    Msg(usize, usize, Msg, Vec<OwnedFd>),
    /// Rank r's connection `id` closed.
    Closed(usize, usize),
    Exited(usize, ExitStatus),
}

/// A fresh abstract socket name for a job's rendezvous, `@tprun-<pid>-<random>`: our pid tells
/// whose it is (`ss -xl`), the random part keeps another process from guessing it before we
/// bind it. An abstract name has no file and no permissions; the handshake checks each
/// client's uid and the job token.
fn rendezvous_name() -> anyhow::Result<PathBuf> {
    let salt = random_token().map_err(|e| anyhow::anyhow!("reading /dev/urandom: {e}"))?;
    Ok(PathBuf::from(format!(
        "@tprun-{}-{}",
        std::process::id(),
        hex(&salt[..8])
    )))
}

pub fn random_token() -> anyhow::Result<[u8; 16]> {
    let mut t = [0u8; 16];
    let mut f = std::fs::File::open("/dev/urandom")?;
    std::io::Read::read_exact(&mut f, &mut t)?;
    Ok(t)
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

struct RankState {
    pid: u32,
    /// Until the waiter thread reports the exit.
    child_alive: bool,
    /// The exit status, once known, and when it was seen. A rank is judged only once its
    /// connection has closed too (or a grace period passed): its last messages (Done, Failed)
    /// and its exit arrive on different threads, in either order.
    exit: Option<(ExitStatus, Instant)>,
    closed: bool,
    judged: bool,
    conn: Option<Arc<Conn>>,
    device: String,
    device_uuid: String,
    exported: Option<(Vec<tprun_ipc::wire::ExportItem>, Vec<OwnedFd>)>,
    done: bool,
    /// The rank's own last words (Failed), if any.
    failed: Option<Failure>,
}

/// Runs a job to the end. `Ok(())` when every rank finished and exited 0.
pub fn run(launch: Launch, observer: &mut dyn Observer) -> Result<(), JobError> {
    install_signal_handlers();
    let world = launch.world;
    let (token, sock_path, socket_file) = match &launch.listen {
        // Bind fails if the path exists (checked sooner, in serve's `join_point`).
        Some(l) => (l.token, l.path.clone(), Some(l.path.clone())),
        None => {
            let t = random_token().map_err(|e| anyhow::anyhow!("reading /dev/urandom: {e}"))?;
            (t, rendezvous_name()?, None)
        }
    };
    let listener =
        Listener::bind(&sock_path).map_err(|e| anyhow::anyhow!("rendezvous socket: {e}"))?;
    // From here on the acceptor owns the socket file: it removes it when it stops.
    let socket_file = SocketFile(socket_file);
    let control = Arc::new(
        ControlBlock::create(world, &token)
            .map_err(|e| anyhow::anyhow!("control block: {e}"))?
            .with_phase_names(&Phase::NAMES),
    );
    observer.attach(&control);
    // Each rank's plan: the job, and the device it runs on.
    let plans: Vec<Vec<u8>> = launch
        .devices
        .iter()
        .map(|&device| {
            job::encode(&Plan {
                job: launch.spec.clone(),
                device,
            })
        })
        .collect();

    let (tx, rx) = mpsc::channel::<Event>();
    let accepting = Arc::new(AtomicBool::new(true));
    let ours = OurRanks::default();
    let acceptor = spawn_acceptor(
        Acceptor {
            listener,
            socket_file,
            token,
            world,
            // The abstract socket has no permissions of its own: the uid check is its gate. A
            // socket file's permissions are the listening one's, and ranks in other containers
            // may have other uids: the token is the gate.
            check_uid: launch.listen.is_none(),
            ours: ours.clone(),
        },
        tx.clone(),
        accepting.clone(),
    );

    let mut ranks: Vec<RankState> = Vec::with_capacity(world);
    for (r, &device) in launch.devices.iter().enumerate() {
        let spawned = if launch.listen.is_some() {
            Ok(0)
        } else {
            spawn_rank(r, device, &sock_path, &token, tx.clone()).inspect(|&pid| ours.add(pid))
        };
        match spawned {
            Ok(pid) => ranks.push(RankState {
                pid,
                child_alive: launch.listen.is_none(),
                exit: None,
                closed: false,
                judged: false,
                conn: None,
                device: format!("{}:{device}", launch.spec.backend.name()),
                device_uuid: String::new(),
                exported: None,
                done: false,
                failed: None,
            }),
            Err(e) => {
                accepting.store(false, Ordering::SeqCst);
                stop_ranks(&control, &ranks);
                return Err(JobError::Setup(e));
            }
        }
    }
    drop(tx);

    let mut sup = Supervisor {
        launch: &launch,
        control,
        ranks,
        accepting,
        plans,
        joined: 0,
        peers_sent: false,
        error: None,
        started: Instant::now(),
        last_progress: Instant::now(),
        last_beats: vec![0; world],
        tokens: Vec::new(),
        stopping: false,
        failed_at: None,
        reminded: Instant::now(),
    };
    let result = sup.supervise(&rx, observer);
    drop(sup);
    let _ = acceptor.join();
    result
}

struct Supervisor<'a> {
    launch: &'a Launch,
    control: Arc<ControlBlock>,
    ranks: Vec<RankState>,
    accepting: Arc<AtomicBool>,
    /// Each rank's encoded `Plan`, sent in its `Welcome`.
    plans: Vec<Vec<u8>>,
    joined: usize,
    peers_sent: bool,
    /// The first real failure; later ones (ranks that only saw the abort) are not reported.
    error: Option<JobError>,
    started: Instant,
    last_progress: Instant,
    last_beats: Vec<u64>,
    tokens: Vec<(u32, u32)>,
    /// The observer took the first interrupt ([`Observer::stop`]).
    stopping: bool,
    /// When the job failed: remote ranks get a grace period to see the abort and hang up.
    failed_at: Option<Instant>,
    /// When we last said which ranks a `--listen` job still waits for.
    reminded: Instant,
}

impl Supervisor<'_> {
    fn supervise(
        &mut self,
        rx: &Receiver<Event>,
        observer: &mut dyn Observer,
    ) -> Result<(), JobError> {
        loop {
            match rx.recv_timeout(observer.tick_interval()) {
                Ok(ev) => {
                    // Tokens a rank published before sending a message reach the observer
                    // before the message (`serve` ends a request on a report).
                    self.flush_tokens(observer);
                    self.handle(ev, observer)
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            self.flush_tokens(observer);
            // A signal is read once per tick: offered to the observer first (a graceful stop,
            // once every rank has joined and only the first time), else the job is aborted
            // (in check_interrupt_and_stall).
            let interrupted = INTERRUPTED.swap(false, Ordering::SeqCst);
            let mut interrupt_handled = false;
            if self.error.is_none() && self.joined == self.launch.world {
                let conns: Vec<&Conn> = self
                    .ranks
                    .iter()
                    .filter_map(|r| r.conn.as_deref())
                    .collect();
                if conns.len() == self.launch.world {
                    let ranks = RankConns { conns };
                    if interrupted && !self.stopping && observer.stop(&ranks) {
                        self.stopping = true;
                        interrupt_handled = true;
                    }
                    if let Err(e) = observer.tick(&ranks) {
                        // Sending to a rank failed: its connection is gone.
                        self.fail(JobError::Setup(e), AbortReason::RankFailed, None);
                    }
                }
            }
            for r in 0..self.ranks.len() {
                self.judge(r);
            }
            if self.ranks.iter().all(|r| r.judged) {
                break;
            }
            if self.error.is_none() {
                self.check_interrupt_and_stall(interrupted && !interrupt_handled);
            }
        }
        self.accepting.store(false, Ordering::SeqCst);
        // Drain tokens published just before the end.
        self.flush_tokens(observer);
        match self.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn flush_tokens(&mut self, observer: &mut dyn Observer) {
        self.control.pop_tokens(&mut self.tokens);
        if !self.tokens.is_empty() {
            observer.tokens(&self.tokens);
            self.tokens.clear();
        }
    }

    fn fail(&mut self, err: JobError, reason: AbortReason, rank: Option<usize>) {
        if self.error.is_none() {
            tracing::debug!("job failed: {err}");
            self.error = Some(err);
            self.failed_at = Some(Instant::now());
        }
        self.control.abort(reason, rank);
        stop_ranks(&self.control, &self.ranks);
    }

    fn describe(&self, r: usize) -> String {
        let s = &self.ranks[r];
        format!("rank {r} (pid {}, device {})", s.pid, s.device)
    }

    /// Whether connection `id` (the address of its `Conn`) is rank r's admitted one.
    fn is_conn(&self, r: usize, id: usize) -> bool {
        self.ranks[r].conn.as_ref().map(|c| Arc::as_ptr(c) as usize) == Some(id)
    }

    fn handle(&mut self, ev: Event, observer: &mut dyn Observer) {
        match ev {
            Event::Joined(r, conn, pid) => self.on_join(r, conn, pid),
            Event::Msg(r, id, _, _) if !self.is_conn(r, id) => {
                // A refused duplicate claiming an admitted rank's number: ignore it.
            }
            Event::Msg(r, _, msg, fds) => match msg {
                Msg::Export {
                    device,
                    device_uuid,
                    items,
                } => {
                    self.ranks[r].device = device;
                    self.ranks[r].device_uuid = device_uuid;
                    self.ranks[r].exported = Some((items, fds));
                    self.last_progress = Instant::now();
                    self.maybe_send_peers();
                }
                Msg::Report { payload } => match job::decode::<Report>(&payload) {
                    Ok(rep) => observer.report(r, rep),
                    Err(e) => {
                        let m = format!("{}: sent an undecodable report: {e}", self.describe(r));
                        let err = JobError::RankError(FailKind::Internal, m);
                        self.fail(err, AbortReason::RankFailed, Some(r));
                    }
                },
                Msg::Failed { payload } => {
                    let f = job::decode::<Failure>(&payload).unwrap_or_else(|e| Failure {
                        kind: FailKind::Internal,
                        phase: self.control.phase_name(r),
                        message: format!("an undecodable failure report: {e}"),
                    });
                    let (kind, phase, message) = (f.kind, f.phase.clone(), f.message.clone());
                    self.ranks[r].failed = Some(f);
                    if self.error.is_some()
                        && (kind == FailKind::Aborted || self.control.aborted().is_some())
                    {
                        return; // only saw the abort caused by an earlier failure
                    }
                    let text = format!("{} failed during {phase}: {message}", self.describe(r));
                    let (err, reason) = JobError::from_failure(kind, text);
                    self.fail(err, reason, Some(r));
                }
                Msg::Done => self.ranks[r].done = true,
                other => {
                    let m = format!("{}: unexpected message {other:?}", self.describe(r));
                    let err = JobError::RankError(FailKind::Internal, m);
                    self.fail(err, AbortReason::RankFailed, Some(r));
                }
            },
            Event::Closed(r, id) => {
                // A refused duplicate's connection closing says nothing of rank r.
                if self.is_conn(r, id) {
                    self.ranks[r].closed = true;
                    self.judge(r);
                }
            }
            Event::Exited(r, status) => {
                self.ranks[r].child_alive = false;
                self.ranks[r].exit = Some((status, Instant::now()));
                self.judge(r);
            }
        }
    }

    /// Decides whether rank `r`'s exit was a failure, once both its exit status and the end
    /// of its connection are known (or its exit is old enough that no more messages come).
    fn judge(&mut self, r: usize) {
        if self.remote() {
            return self.judge_remote(r);
        }
        let s = &self.ranks[r];
        let Some((status, when)) = s.exit else { return };
        let settled = s.closed || s.conn.is_none() || when.elapsed() > CLOSE_GRACE;
        if s.judged || !settled {
            return;
        }
        self.ranks[r].judged = true;
        let s = &self.ranks[r];
        if (status.success() && s.done) || self.error.is_some() || s.failed.is_some() {
            return;
        }
        let phase = self.control.phase_name(r);
        let how = match (status.code(), status.signal()) {
            (_, Some(sig)) => format!(
                "killed by {}",
                Signal::try_from(sig).map_or(format!("signal {sig}"), |s| s.as_str().to_string())
            ),
            (Some(0), _) => "exited without finishing".to_string(),
            (Some(c), _) => format!("exited with status {c}"),
            _ => "ended".to_string(),
        };
        let m = format!("{} {how} during {phase}", self.describe(r));
        self.fail(JobError::RankDied(m), AbortReason::RankFailed, Some(r));
    }

    /// The ranks were started elsewhere and joined at a `--listen` socket: not our children,
    /// so they have no exit status; a connection closing is its rank's end.
    fn remote(&self) -> bool {
        self.launch.listen.is_some()
    }

    /// A rank started elsewhere ends when its connection does: after `Done` or `Failed` that
    /// is its goodbye, before them it died. Once the job has failed, one that never joined, or
    /// that does not hang up within a grace period of the abort, is let go (it is not ours to
    /// kill; the abort stops it when it next looks).
    fn judge_remote(&mut self, r: usize) {
        let s = &self.ranks[r];
        if s.judged {
            return;
        }
        let given_up = self
            .failed_at
            .is_some_and(|t| s.conn.is_none() || t.elapsed() > KILL_GRACE * 4);
        if !s.closed && !given_up {
            return;
        }
        self.ranks[r].judged = true;
        let s = &self.ranks[r];
        if s.done || self.error.is_some() || s.failed.is_some() || !s.closed {
            return;
        }
        let phase = self.control.phase_name(r);
        let m = format!("{} disconnected during {phase}", self.describe(r));
        self.fail(JobError::RankDied(m), AbortReason::RankFailed, Some(r));
    }

    fn on_join(&mut self, r: usize, conn: Arc<Conn>, pid: u32) {
        if self.ranks[r].conn.is_some() {
            let _ = conn.send(
                &Msg::Refused {
                    reason: format!("rank {r} has already joined"),
                },
                &[],
            );
            eprintln!("tprun: refused a second connection claiming rank {r}");
            return;
        }
        let sent = conn.send(
            &Msg::Welcome {
                world: self.launch.world as u32,
                job: self.plans[r].clone(),
            },
            &[self.control.fd()],
        );
        if let Err(e) = sent {
            tracing::debug!("rank {r}: Welcome not delivered: {e}");
        }
        self.ranks[r].conn = Some(conn);
        self.joined += 1;
        self.last_progress = Instant::now();
        if self.remote() {
            self.ranks[r].pid = pid;
            eprintln!(
                "tprun: rank {r} joined (pid {pid}); {} of {}",
                self.joined, self.launch.world
            );
        }
        if self.joined == self.launch.world {
            // Everyone is in: nothing else may join (the acceptor stops and drops the
            // listener, which frees the name).
            self.accepting.store(false, Ordering::SeqCst);
        }
    }

    fn maybe_send_peers(&mut self) {
        if self.peers_sent || self.ranks.iter().any(|r| r.exported.is_none()) {
            return;
        }
        self.peers_sent = true;
        let mut by_dev: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (r, s) in self.ranks.iter().enumerate() {
            by_dev.entry(s.device_uuid.as_str()).or_default().push(r);
        }
        if self.launch.spec.backend != tprun_rank::job::Backend::Cpu {
            if let Some((dev, rs)) = by_dev.iter().find(|(_, rs)| rs.len() > 1) {
                eprintln!(
                    "tprun: warning: ranks {rs:?} share device {dev}; their kernels overlap only \
                     under the CUDA MPS daemon (nvidia-cuda-mps-control -d), otherwise every \
                     cross-rank wait costs milliseconds"
                );
            }
        }
        let items: Vec<_> = self
            .ranks
            .iter()
            .map(|s| s.exported.as_ref().expect("checked above").0.clone())
            .collect();
        for r in 0..self.ranks.len() {
            let fds: Vec<_> = self
                .ranks
                .iter()
                .flat_map(|s| {
                    s.exported
                        .as_ref()
                        .expect("checked above")
                        .1
                        .iter()
                        .map(|f| f.as_fd())
                })
                .collect();
            let conn = self.ranks[r]
                .conn
                .clone()
                .expect("every rank joined before exporting");
            if let Err(e) = conn.send(
                &Msg::Peers {
                    items: items.clone(),
                },
                &fds,
            ) {
                tracing::debug!("rank {r}: Peers not delivered: {e}");
            }
        }
        // The descriptors are in the ranks' hands now; ours are no longer needed.
        for s in &mut self.ranks {
            if let Some((_, fds)) = &mut s.exported {
                fds.clear();
            }
        }
    }

    fn check_interrupt_and_stall(&mut self, interrupted: bool) {
        if interrupted {
            self.fail(JobError::Interrupted, AbortReason::Interrupted, None);
            return;
        }
        let timeout = self.launch.timeout;
        if self.joined < self.launch.world {
            let missing: Vec<usize> = (0..self.launch.world)
                .filter(|&r| self.ranks[r].conn.is_none())
                .collect();
            if self.remote() {
                // Ranks started by hand or by an orchestrator may take any time to come.
                if self.reminded.elapsed() > LISTEN_REMINDER {
                    self.reminded = Instant::now();
                    eprintln!("tprun: still waiting for rank(s) {missing:?} to join");
                }
                return;
            }
            if self.started.elapsed() > timeout {
                let m = format!(
                    "timed out after {:.0?} waiting for rank(s) {missing:?} to join",
                    timeout
                );
                self.fail(JobError::Timeout(m), AbortReason::Timeout, None);
            }
            return;
        }
        // Progress is any heartbeat change. Ranks' own waits time out first (after `timeout`)
        // and say who is missing; this catches a job where nobody waits (one rank, or all stuck).
        let beats: Vec<u64> = (0..self.launch.world)
            .map(|r| self.control.heartbeat(r))
            .collect();
        if beats != self.last_beats {
            self.last_beats = beats;
            self.last_progress = Instant::now();
        } else if self.last_progress.elapsed() > timeout + Duration::from_secs(1)
            && !self.peers_sent
        {
            // Ranks that have exported wait for us (they cannot tell who is missing, and
            // their own deadline is later: rank/src/comm.rs, PEERS_SLACK); name the others.
            let missing: Vec<usize> = (0..self.launch.world)
                .filter(|&r| self.ranks[r].exported.is_none())
                .collect();
            let what: Vec<String> = missing
                .iter()
                .map(|&r| format!("{} in {}", self.describe(r), self.control.phase_name(r)))
                .collect();
            let m = format!(
                "no progress for {:.0?} waiting for rank(s) {missing:?} to set up their buffers: {}",
                timeout,
                what.join(", ")
            );
            let first = missing.first().copied();
            self.fail(JobError::Timeout(m), AbortReason::Timeout, first);
        } else if self.last_progress.elapsed() > timeout + Duration::from_secs(1) {
            let live: Vec<String> = (0..self.launch.world)
                .filter(|&r| {
                    let s = &self.ranks[r];
                    !s.done && (s.child_alive || (self.remote() && !s.closed))
                })
                .map(|r| format!("rank {r} in {}", self.control.phase_name(r)))
                .collect();
            let m = format!(
                "no progress for {:.0?}: {}",
                timeout,
                if live.is_empty() {
                    "no rank running".to_string()
                } else {
                    live.join(", ")
                }
            );
            self.fail(JobError::Timeout(m), AbortReason::Timeout, None);
        }
    }
}

impl Drop for Supervisor<'_> {
    fn drop(&mut self) {
        // Whatever happened, no rank outlives the job.
        if self.ranks.iter().any(|r| r.child_alive) {
            if self.control.aborted().is_none() {
                self.control.abort(AbortReason::RankFailed, None);
            }
            stop_ranks(&self.control, &self.ranks);
        }
    }
}

/// SIGTERM every live rank, then SIGKILL after a grace period, and wait for none of them: the
/// waiter threads report their exits.
fn stop_ranks(control: &ControlBlock, ranks: &[RankState]) {
    let live: Vec<Pid> = ranks
        .iter()
        .filter(|r| r.child_alive)
        .map(|r| Pid::from_raw(r.pid as i32))
        .collect();
    if live.is_empty() {
        return;
    }
    tracing::debug!(
        "stopping {} rank(s): {}",
        live.len(),
        control
            .aborted()
            .map_or("no abort".into(), |(r, w)| describe_abort(r, w))
    );
    for &p in &live {
        let _ = signal::kill(p, Signal::SIGTERM);
    }
    thread::spawn(move || {
        thread::sleep(KILL_GRACE);
        for p in live {
            // ESRCH if it is gone already. A reaped pid could in principle be reused within
            // the grace period; the waiter threads reap quickly and pids are not recycled that
            // fast on Linux (they wrap around pid_max first).
            let _ = signal::kill(p, Signal::SIGKILL);
        }
    });
}

fn install_signal_handlers() {
    for sig in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        let action = signal::SigAction::new(
            signal::SigHandler::Handler(on_signal),
            signal::SaFlags::SA_RESTART,
            signal::SigSet::empty(),
        );
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            let _ = signal::sigaction(sig, &action);
        }
    }
}

fn spawn_rank(
    rank: usize,
    device: usize,
    sock: &Path,
    token: &[u8; 16],
    tx: Sender<Event>,
) -> anyhow::Result<u32> {
    let exe =
        std::env::current_exe().map_err(|e| anyhow::anyhow!("finding our own binary: {e}"))?;
    let parent = std::process::id() as i32;
    let mut cmd = Command::new(exe);
    cmd.arg("rank")
        .arg("--join")
        .arg(sock)
        .arg("--rank")
        .arg(rank.to_string())
        .env("TPRUN_JOB_TOKEN", hex(token))
        // Our rank reports its failures to us; we print them (main.rs, spawned_by_parent).
        .env("TPRUN_SPAWNED_BY", std::process::id().to_string())
        // The rank's only visible GPU; everything else about the job it learns from its plan.
        .env("CUDA_VISIBLE_DEVICES", device.to_string())
        .env("HIP_VISIBLE_DEVICES", device.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: the closure runs in the child between fork and exec and calls only
    // async-signal-safe functions (prctl, getppid, setpgid, _exit).
    unsafe {
        cmd.pre_exec(move || {
            // Die with the coordinator. If it is already gone (the parent changed before prctl
            // took effect), exit now.
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            // Our own process group: a terminal's Ctrl-C reaches the coordinator only, which
            // then stops the ranks in order instead of racing them.
            libc::setpgid(0, 0);
            Ok(())
        });
    }
    let mut child: Child = cmd
        .spawn()
        .map_err(|e| anyhow::anyhow!("starting rank {rank}: {e}"))?;
    let pid = child.id();
    let out = child.stdout.take().expect("piped");
    let err = child.stderr.take().expect("piped");
    forward_output(rank, out);
    forward_output(rank, err);
    thread::spawn(move || {
        if let Ok(status) = child.wait() {
            let _ = tx.send(Event::Exited(rank, status));
        }
    });
    Ok(pid)
}

/// Copies a rank's output to our stderr, each line prefixed with `[rank i]`.
fn forward_output(rank: usize, stream: impl std::io::Read + Send + 'static) {
    thread::spawn(move || {
        let reader = BufReader::new(stream);
        for line in reader.split(b'\n').map_while(Result::ok) {
            let mut e = std::io::stderr().lock();
            let _ = write!(e, "[rank {rank}] ");
            let _ = e.write_all(&line);
            let _ = e.write_all(b"\n");
        }
    });
}

/// The pids of the rank processes this coordinator spawned: a connection from one of them
/// that fails its hello is this job's own rank cut off (typically stopped by an early abort,
/// whose cause is reported already), not a stranger to warn about.
#[derive(Clone, Default)]
struct OurRanks(Arc<std::sync::Mutex<Vec<u32>>>);

impl OurRanks {
    fn add(&self, pid: u32) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(pid);
    }

    fn contains(&self, pid: u32) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&pid)
    }
}

/// The acceptor thread's listening socket and what it checks clients against.
struct Acceptor {
    listener: Listener,
    /// The socket's file, removed when the acceptor stops.
    socket_file: SocketFile,
    token: [u8; 16],
    world: usize,
    check_uid: bool,
    ours: OurRanks,
}

/// A listening socket's file (none for an abstract name): removed when dropped.
struct SocketFile(Option<PathBuf>);

impl Drop for SocketFile {
    fn drop(&mut self) {
        if let Some(p) = &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn spawn_acceptor(
    a: Acceptor,
    tx: Sender<Event>,
    accepting: Arc<AtomicBool>,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let my_uid = a.check_uid.then(|| nix::unistd::getuid().as_raw());
        while accepting.load(Ordering::SeqCst) {
            let conn = match a.listener.accept(Duration::from_millis(20)) {
                Ok(Some(c)) => c,
                Ok(None) => continue,
                Err(e) => {
                    tracing::debug!("accept: {e}");
                    continue;
                }
            };
            let (tx, ours, token, world) = (tx.clone(), a.ours.clone(), a.token, a.world);
            thread::spawn(move || handshake(conn, token, world, my_uid, tx, &ours));
        }
        // The listener closes, then its file goes.
        drop(a.listener);
        drop(a.socket_file);
    })
}

/// Admits one client, or refuses it with a log line; a refused client never disturbs the job.
/// One of this job's own rank processes is not logged as a stranger: when its hello fails, it
/// was cut off (an early abort stops ranks mid-hello), and the supervisor reports its end.
fn handshake(
    conn: Conn,
    token: [u8; 16],
    world: usize,
    my_uid: Option<u32>,
    tx: Sender<Event>,
    ours: &OurRanks,
) {
    let cred = conn.peer_cred();
    let who = cred
        .as_ref()
        .map_or("unknown pid".to_string(), |c| format!("pid {}", c.pid));
    let refuse = |reason: String| {
        // Looked up now, not at accept: a rank can connect before its spawn has returned its
        // pid, but it is cut off only once the job stops, after every spawn has returned.
        if cred
            .as_ref()
            .is_ok_and(|c| c.pid > 0 && ours.contains(c.pid as u32))
        {
            tracing::debug!("this job's rank process {who} did not join: {reason}");
        } else {
            eprintln!("tprun: refused a connection from {who}: {reason}");
        }
        let _ = conn.send(&Msg::Refused { reason }, &[]);
    };
    match (&cred, my_uid) {
        (Ok(c), Some(me)) if c.uid != me => {
            return refuse(format!("uid {} is not ours ({me})", c.uid))
        }
        (Ok(_), _) => {}
        (Err(e), _) => return refuse(format!("its credentials are unknown: {e}")),
    }
    let (msg, _fds) = match conn.recv(Some(HELLO_TIMEOUT)) {
        Ok(m) => m,
        Err(e) => return refuse(format!("no valid Hello: {e}")),
    };
    let Msg::Hello { token: t, rank, .. } = msg else {
        return refuse("the first message was not Hello".into());
    };
    if t != token {
        return refuse("wrong job token".into());
    }
    let rank = rank as usize;
    if rank >= world {
        return refuse(format!("rank {rank} is outside a world of {world}"));
    }
    let conn = Arc::new(conn);
    let id = Arc::as_ptr(&conn) as usize;
    let pid = cred.map_or(0, |c| c.pid.max(0) as u32);
    if tx.send(Event::Joined(rank, conn.clone(), pid)).is_err() {
        return;
    }
    loop {
        match conn.recv(None) {
            Ok((m, fds)) => {
                if tx.send(Event::Msg(rank, id, m, fds)).is_err() {
                    return;
                }
            }
            Err(_) => {
                let _ = tx.send(Event::Closed(rank, id));
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_kind_decides_the_exit_code_and_the_hint() {
        let (e, reason) = JobError::from_failure(FailKind::Timeout, "rank 1 ...".into());
        assert_eq!((e.exit_code(), reason), (4, AbortReason::Timeout));
        assert!(e.hint().unwrap().contains("--timeout"));
        let (e, reason) = JobError::from_failure(FailKind::Device, "rank 0 ...".into());
        assert_eq!((e.exit_code(), reason), (1, AbortReason::RankFailed));
        assert!(e.hint().unwrap().contains("selftest"));
        // A message that reads like a timeout is still what its kind says.
        let (e, _) = JobError::from_failure(FailKind::Input, "timed out reading".into());
        assert_eq!(e.exit_code(), 1);
        assert_eq!(e.to_string(), "timed out reading");
    }
}
