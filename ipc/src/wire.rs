//! The wire protocol between the coordinator and its ranks.
//!
//! One Unix `SOCK_SEQPACKET` connection per rank. Seqpacket keeps message boundaries (one
//! `sendmsg` = one `recvmsg`) and delivers in order, so a frame needs no length prefix, and
//! file descriptors ride along with the frame they belong to (`SCM_RIGHTS`).
//!
//! An address is a filesystem path, or `@name` for a Linux abstract socket: a name with no
//! file behind it, which vanishes with the listening socket however its owner dies (the
//! coordinator's own rendezvous uses one, so that a SIGKILL cannot leave a socket file behind).
//! Abstract names have no permissions: the listener checks each client's uid (`SO_PEERCRED`)
//! and job token instead.
//!
//! A frame is `MAGIC (4 bytes) | PROTOCOL_VERSION (u32 LE) | postcard(Msg)`. The magic and
//! version come first and in a fixed encoding so that a peer of another version, or a stray
//! client writing garbage, is told apart from a bug before any payload is decoded.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::socket::{
    self, AddressFamily, Backlog, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag,
    SockType, UnixAddr,
};
use serde::{Deserialize, Serialize};

use crate::{IpcError, Result};

/// Bumped whenever `Msg` or the control-block layout changes incompatibly.
pub const PROTOCOL_VERSION: u32 = 2;
const MAGIC: [u8; 4] = *b"TPRN";
const HEADER: usize = 8;
/// Largest frame accepted. Frames are small (reports are summaries, not raw samples); the
/// limit only bounds the receive buffer.
pub const MAX_FRAME: usize = 1 << 20;
/// Most descriptors accepted with one frame (the kernel's SCM_MAX_FD is 253).
pub const MAX_FDS: usize = 200;

/// One shareable object as a rank describes it: an opaque description for the backend and
/// whether a descriptor travels with it (in frame order).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExportItem {
    pub meta: Vec<u8>,
    pub has_fd: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub enum Msg {
    /// rank → coordinator, first frame: who I am. The token proves the rank was started by
    /// (or given the secret of) this job.
    Hello {
        token: [u8; 16],
        rank: u32,
        pid: u32,
    },
    /// coordinator → rank: admitted. Carries the job spec (opaque to this crate) and, as its
    /// one descriptor, the control-block memfd.
    Welcome { world: u32, job: Vec<u8> },
    /// coordinator → client: not admitted, and why. The connection is closed after it.
    Refused { reason: String },
    /// rank → coordinator: the device this rank runs on (description and a stable identity,
    /// to name it in errors and to notice ranks sharing a device) and its shareable buffers;
    /// descriptors in item order.
    Export {
        device: String,
        device_uuid: String,
        items: Vec<ExportItem>,
    },
    /// coordinator → rank: every rank's exports, indexed by rank; descriptors in order.
    Peers { items: Vec<Vec<ExportItem>> },
    /// rank → coordinator: a result (bench row, decode statistics), opaque to this crate.
    Report { payload: Vec<u8> },
    /// rank → coordinator: this rank failed, and why (its phase, the kind of failure and the
    /// message; opaque to this crate); it exits after sending this.
    Failed { payload: Vec<u8> },
    /// rank → coordinator: this rank finished its work and will exit 0.
    Done,
    /// coordinator → rank, during a job that takes work (`serve`): the next piece of it,
    /// opaque to this crate.
    Work { payload: Vec<u8> },
}

/// One end of a seqpacket connection.
#[derive(Debug)]
pub struct Conn {
    fd: OwnedFd,
}

/// A listening seqpacket socket bound to a path or an abstract name.
#[derive(Debug)]
pub struct Listener {
    fd: OwnedFd,
}

/// What `SO_PEERCRED` says about the other end.
#[derive(Clone, Copy, Debug)]
pub struct PeerCred {
    pub pid: i32,
    pub uid: u32,
}

fn new_socket() -> Result<OwnedFd> {
    socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| IpcError::os("creating a seqpacket socket", e))
}

/// The socket address `addr` names: `@name` is the abstract name `name`, anything else a path.
fn unix_addr(addr: &Path) -> Result<UnixAddr> {
    match addr.as_os_str().as_bytes().strip_prefix(b"@") {
        Some(name) => UnixAddr::new_abstract(name),
        None => UnixAddr::new(addr),
    }
    .map_err(|e| IpcError::os(format!("socket address {}", addr.display()), e))
}

impl Listener {
    /// Listens at `path`: a filesystem path (the caller removes the file), or `@name` for an
    /// abstract name (nothing to remove).
    pub fn bind(path: &Path) -> Result<Listener> {
        let fd = new_socket()?;
        let addr = unix_addr(path)?;
        socket::bind(fd.as_raw_fd(), &addr)
            .map_err(|e| IpcError::os(format!("binding {}", path.display()), e))?;
        socket::listen(&fd, Backlog::new(128).expect("128 is a valid backlog"))
            .map_err(|e| IpcError::os("listen", e))?;
        Ok(Listener { fd })
    }

    /// Accepts one connection, waiting at most `timeout`; `Ok(None)` on timeout.
    pub fn accept(&self, timeout: Duration) -> Result<Option<Conn>> {
        if !wait_readable(self.fd.as_fd(), timeout)? {
            return Ok(None);
        }
        let raw = socket::accept4(self.fd.as_raw_fd(), SockFlag::SOCK_CLOEXEC)
            .map_err(|e| IpcError::os("accept", e))?;
        // SAFETY: accept4 returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(Some(Conn { fd }))
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsFd for Conn {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Polls `fd` for input for at most `timeout`. True when readable (or hung up).
fn wait_readable(fd: BorrowedFd<'_>, timeout: Duration) -> Result<bool> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let ms = left.as_millis().min(i32::MAX as u128) as i32;
        let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
        match poll(
            &mut fds,
            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
        ) {
            Ok(0) => return Ok(false),
            Ok(_) => return Ok(true),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(IpcError::os("poll", e)),
        }
    }
}

impl Conn {
    /// Connects to a listener at `path` (a filesystem path, or `@name`: see [`Listener::bind`]).
    pub fn connect(path: &Path) -> Result<Conn> {
        let fd = new_socket()?;
        let addr = unix_addr(path)?;
        socket::connect(fd.as_raw_fd(), &addr)
            .map_err(|e| IpcError::os(format!("connecting to {}", path.display()), e))?;
        Ok(Conn { fd })
    }

    /// A connected pair (for tests).
    pub fn pair() -> Result<(Conn, Conn)> {
        let (a, b) = socket::socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| IpcError::os("socketpair", e))?;
        Ok((Conn { fd: a }, Conn { fd: b }))
    }

    pub fn peer_cred(&self) -> Result<PeerCred> {
        let c = socket::getsockopt(&self.fd, socket::sockopt::PeerCredentials)
            .map_err(|e| IpcError::os("SO_PEERCRED", e))?;
        Ok(PeerCred {
            pid: c.pid(),
            uid: c.uid(),
        })
    }

    /// Sends one frame with `fds` attached.
    pub fn send(&self, msg: &Msg, fds: &[BorrowedFd<'_>]) -> Result<()> {
        self.send_raw(&encode(msg)?, fds)
    }

    /// Sends raw bytes as one frame (tests use it to play a misbehaving client).
    pub fn send_raw(&self, frame: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        if frame.len() > MAX_FRAME || fds.len() > MAX_FDS {
            return Err(IpcError::Protocol(format!(
                "frame of {} bytes with {} descriptors exceeds the limits",
                frame.len(),
                fds.len()
            )));
        }
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let cmsgs = if raw.is_empty() {
            vec![]
        } else {
            vec![ControlMessage::ScmRights(&raw)]
        };
        let iov = [IoSlice::new(frame)];
        loop {
            match socket::sendmsg::<()>(
                self.fd.as_raw_fd(),
                &iov,
                &cmsgs,
                MsgFlags::MSG_NOSIGNAL,
                None,
            ) {
                Ok(_) => return Ok(()),
                Err(nix::errno::Errno::EINTR) => continue,
                Err(nix::errno::Errno::EPIPE) | Err(nix::errno::Errno::ECONNRESET) => {
                    return Err(IpcError::Closed)
                }
                Err(e) => return Err(IpcError::os("sendmsg", e)),
            }
        }
    }

    /// Receives one frame, waiting at most `timeout` (forever if `None`).
    pub fn recv(&self, timeout: Option<Duration>) -> Result<(Msg, Vec<OwnedFd>)> {
        if let Some(t) = timeout {
            if !wait_readable(self.fd.as_fd(), t)? {
                return Err(IpcError::Timeout(t));
            }
        }
        let mut buf = vec![0u8; MAX_FRAME];
        let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS]);
        let (len, fds, truncated) = loop {
            let mut iov = [IoSliceMut::new(&mut buf)];
            match socket::recvmsg::<()>(
                self.fd.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            ) {
                Ok(m) => {
                    let mut fds = Vec::new();
                    for c in m
                        .cmsgs()
                        .map_err(|e| IpcError::os("reading control messages", e))?
                    {
                        if let ControlMessageOwned::ScmRights(raw) = c {
                            for r in raw {
                                // SAFETY: the kernel just installed this descriptor in our
                                // table for us; nothing else owns it.
                                fds.push(unsafe { OwnedFd::from_raw_fd(r) });
                            }
                        }
                    }
                    let trunc = m
                        .flags
                        .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
                    break (m.bytes, fds, trunc);
                }
                Err(nix::errno::Errno::EINTR) => continue,
                Err(nix::errno::Errno::ECONNRESET) => return Err(IpcError::Closed),
                Err(e) => return Err(IpcError::os("recvmsg", e)),
            }
        };
        if len == 0 {
            return Err(IpcError::Closed);
        }
        if truncated {
            return Err(IpcError::Protocol("frame or descriptors truncated".into()));
        }
        Ok((decode(&buf[..len])?, fds))
    }
}

/// One frame: the magic, the version, then `msg`.
pub fn encode(msg: &Msg) -> Result<Vec<u8>> {
    let mut frame = Vec::with_capacity(256);
    frame.extend_from_slice(&MAGIC);
    frame.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    postcard::to_extend(msg, frame)
        .map_err(|e| IpcError::Protocol(format!("encoding {msg:?}: {e}")))
}

/// Checks the magic and version, then decodes the payload.
pub fn decode(frame: &[u8]) -> Result<Msg> {
    if frame.len() < HEADER || frame[..4] != MAGIC {
        return Err(IpcError::Protocol(format!(
            "not a tprun frame ({} bytes, starts {:02x?})",
            frame.len(),
            &frame[..frame.len().min(4)]
        )));
    }
    let version = u32::from_le_bytes([frame[4], frame[5], frame[6], frame[7]]);
    if version != PROTOCOL_VERSION {
        return Err(IpcError::Protocol(format!(
            "protocol version {version}, expected {PROTOCOL_VERSION} (mixed tprun builds?)"
        )));
    }
    postcard::from_bytes(&frame[HEADER..])
        .map_err(|e| IpcError::Protocol(format!("undecodable frame: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    #[test]
    fn frames_round_trip_with_descriptors() {
        let (a, b) = Conn::pair().unwrap();
        let memfd =
            nix::sys::memfd::memfd_create(c"t", nix::sys::memfd::MFdFlags::empty()).unwrap();
        let mut f = std::fs::File::from(memfd);
        f.write_all(b"hello").unwrap();
        let msg = Msg::Welcome {
            world: 3,
            job: vec![1, 2, 3],
        };
        a.send(&msg, &[f.as_fd()]).unwrap();
        let (got, fds) = b.recv(Some(Duration::from_secs(1))).unwrap();
        assert_eq!(got, msg);
        assert_eq!(fds.len(), 1);
        let mut g = std::fs::File::from(fds.into_iter().next().unwrap());
        g.rewind().unwrap();
        let mut s = String::new();
        g.read_to_string(&mut s).unwrap();
        assert_eq!(s, "hello");
    }

    #[test]
    fn garbage_and_wrong_versions_are_protocol_errors() {
        let (a, b) = Conn::pair().unwrap();
        a.send_raw(b"GET / HTTP/1.1\r\n", &[]).unwrap();
        assert!(matches!(b.recv(None), Err(IpcError::Protocol(_))));
        let mut frame = MAGIC.to_vec();
        frame.extend_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
        a.send_raw(&frame, &[]).unwrap();
        match b.recv(None) {
            Err(IpcError::Protocol(m)) => assert!(m.contains("version"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn abstract_names_connect_and_vanish_with_the_listener() {
        let name = format!("@tprun-wire-test-{}", std::process::id());
        let l = Listener::bind(Path::new(&name)).unwrap();
        let a = Conn::connect(Path::new(&name)).unwrap();
        let b = l.accept(Duration::from_secs(1)).unwrap().expect("a client");
        a.send(&Msg::Done, &[]).unwrap();
        assert_eq!(b.recv(None).unwrap().0, Msg::Done);
        assert_eq!(b.peer_cred().unwrap().pid, std::process::id() as i32);
        drop(l);
        let e = Conn::connect(Path::new(&name)).unwrap_err().to_string();
        assert!(e.contains(&name), "{e}");
    }

    #[test]
    fn recv_times_out_and_sees_close() {
        let (a, b) = Conn::pair().unwrap();
        assert!(matches!(
            b.recv(Some(Duration::from_millis(20))),
            Err(IpcError::Timeout(_))
        ));
        drop(a);
        assert!(matches!(b.recv(None), Err(IpcError::Closed)));
    }
}
