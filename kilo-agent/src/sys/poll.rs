//! The program's log ring buffer polled by tokio: registering a file descriptor with the
//! reactor is unsafe in tokio's API (the fd must stay open and the same while registered),
//! which holds here because the registration owns the logger that owns the fd.
use std::{
    io,
    os::fd::{AsRawFd, RawFd},
};

use aya_log::EbpfLogger;
use tokio::io::{Interest, unix::AsyncFd};

/// An aya-log logger whose ring buffer tokio can wait on.
pub struct LoggerFd<L>(pub EbpfLogger<L>);

impl<L> AsRawFd for LoggerFd<L> {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// `logger` registered with the reactor, readable when records arrive.
pub fn readable<L>(logger: EbpfLogger<L>) -> io::Result<AsyncFd<LoggerFd<L>>> {
    // SAFETY: the ring buffer's fd is owned by the logger, which the AsyncFd owns: it stays open
    // and the same for the AsyncFd's whole life.
    let registered =
        unsafe { AsyncFd::register_with_interest(LoggerFd(logger), Interest::READABLE) };
    registered.map_err(io::Error::from)
}
