//! Passing one file descriptor alongside frame bytes (SCM_RIGHTS), and sealed memfds for the
//! shared-memory APPEND_KV. The only FFI in the crate; everything here is a safe wrapper.
//!
//! Functions take `BorrowedFd` so they work on a blocking `std` socket and on a non-blocking
//! one inside an async runtime (where `WouldBlock` comes back as an ordinary error).

use std::ffi::CStr;
use std::fs::File;
use std::io;
use std::mem::{size_of, MaybeUninit};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;

/// Most descriptors one [`recv_with_fds`] accepts. A sender that attaches more has its extra
/// descriptors closed by the kernel and the call fails (the connection must then be dropped).
pub const MAX_FDS_PER_RECV: usize = 8;

const FD_BYTES: usize = size_of::<libc::c_int>();

/// Control-message buffer with cmsghdr alignment, large enough for MAX_FDS_PER_RECV fds.
#[repr(C)]
union CmsgBuf {
    _align: libc::cmsghdr,
    bytes: [u8; 128],
}

impl CmsgBuf {
    fn new() -> Self {
        CmsgBuf { bytes: [0u8; 128] }
    }
}

fn cmsg_space(fds: usize) -> usize {
    // SAFETY: CMSG_SPACE only does alignment arithmetic on its argument.
    unsafe { libc::CMSG_SPACE((fds * FD_BYTES) as libc::c_uint) as usize }
}

/// `sendmsg` of `parts` (gathered, in order) with `fd` attached as SCM_RIGHTS. Returns the
/// bytes sent, which may be fewer than the total: the caller writes the rest normally (the
/// descriptor travels with the first byte). Uses MSG_NOSIGNAL: a closed peer is EPIPE.
pub fn send_with_fd(
    sock: BorrowedFd<'_>,
    parts: &[&[u8]],
    fd: BorrowedFd<'_>,
) -> io::Result<usize> {
    let mut iov: Vec<libc::iovec> = parts
        .iter()
        .map(|p| libc::iovec {
            iov_base: p.as_ptr().cast_mut().cast(),
            iov_len: p.len(),
        })
        .collect();
    let mut cbuf = CmsgBuf::new();
    let space = cmsg_space(1);
    debug_assert!(space <= size_of::<CmsgBuf>());
    // SAFETY: msghdr is plain old data; all-zero is a valid (empty) value.
    let mut msg: libc::msghdr = unsafe { MaybeUninit::zeroed().assume_init() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    msg.msg_control = std::ptr::addr_of_mut!(cbuf).cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg_control points at `cbuf`, aligned for cmsghdr and at least CMSG_SPACE(4)
    // bytes long, so CMSG_FIRSTHDR is non-null and the header plus one c_int of data fit.
    // CMSG_DATA may be unaligned for c_int, hence write_unaligned.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(FD_BYTES as libc::c_uint) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd.as_raw_fd());
    }
    loop {
        // SAFETY: `msg` points at iovecs over live borrowed slices and at `cbuf`, all of which
        // outlive the call; the kernel only reads them.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// `recvmsg` into `buf`; descriptors that arrive with the bytes are appended to `fds`
/// (close-on-exec). Returns the byte count (0 = end of stream). Fails with `InvalidData` if
/// the sender attached more than [`MAX_FDS_PER_RECV`] descriptors; the received bytes are then
/// lost and the connection must be closed.
///
/// Linux attaches passed descriptors to the first byte of the `sendmsg` that carried them
/// and never lets one read run past a message that carries descriptors, so a reader that
/// reads each frame exactly (header, then `body_len` bytes) receives a frame's descriptor
/// during that frame's reads.
pub fn recv_with_fds(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = CmsgBuf::new();
    let space = cmsg_space(MAX_FDS_PER_RECV);
    debug_assert!(space <= size_of::<CmsgBuf>());
    // SAFETY: msghdr is plain old data; all-zero is a valid (empty) value.
    let mut msg: libc::msghdr = unsafe { MaybeUninit::zeroed().assume_init() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = std::ptr::addr_of_mut!(cbuf).cast();
    msg.msg_controllen = space as _;
    let n = loop {
        // SAFETY: `iov` covers `buf`, exclusively borrowed for the call; msg_control covers
        // `cbuf` with the stated length. Both outlive the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    };
    // SAFETY: the kernel filled msg_control/msg_controllen; CMSG_FIRSTHDR/CMSG_NXTHDR walk
    // only within msg_controllen, each SCM_RIGHTS payload holds (cmsg_len - CMSG_LEN(0)) / 4
    // descriptors that are now ours (installed by the kernel), so each is owned exactly once.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                let payload = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..payload / FD_BYTES {
                    let raw = std::ptr::read_unaligned(data.add(i));
                    fds.push(OwnedFd::from_raw_fd(raw));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("peer attached more than {MAX_FDS_PER_RECV} file descriptors"),
        ));
    }
    Ok(n)
}

/// Create a memfd holding `payload`, sealed against shrinking, growing and writing, so the
/// receiver can map it without the file changing (or faulting) under it.
pub fn sealed_memfd(name: &CStr, payload: &[u8]) -> io::Result<OwnedFd> {
    // SAFETY: `name` is a valid NUL-terminated string for the duration of the call.
    let raw =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
    let file = unsafe { File::from_raw_fd(raw) };
    // Positional write: the file offset (shared with the receiver) stays at 0.
    file.write_all_at(payload, 0)?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor we own with an integer argument; no memory is passed.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn fd_travels_with_bytes() {
        let (a, b) = UnixStream::pair().unwrap();
        let memfd = sealed_memfd(c"t", b"hello shm").unwrap();
        let n = send_with_fd(a.as_fd(), &[b"ab", b"cd"], memfd.as_fd()).unwrap();
        assert_eq!(n, 4);
        let mut buf = [0u8; 16];
        let mut fds = Vec::new();
        let got = recv_with_fds(b.as_fd(), &mut buf, &mut fds).unwrap();
        assert_eq!(&buf[..got], b"abcd");
        assert_eq!(fds.len(), 1);
        let mut f = File::from(fds.pop().unwrap());
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        assert_eq!(s, "hello shm");
    }

    #[test]
    fn sealed_memfd_rejects_writes_and_truncation() {
        let fd = sealed_memfd(c"t", &[1, 2, 3]).unwrap();
        let mut f = File::from(fd);
        assert!(f.write_all(b"x").is_err());
        assert!(f.set_len(1).is_err());
        assert_eq!(f.metadata().unwrap().len(), 3);
    }

    #[test]
    fn too_many_fds_is_an_error() {
        let (a, b) = UnixStream::pair().unwrap();
        // Hand-build a message with MAX_FDS_PER_RECV + 1 descriptors.
        let fds: Vec<OwnedFd> = (0..=MAX_FDS_PER_RECV)
            .map(|_| sealed_memfd(c"t", b"").unwrap())
            .collect();
        let raws: Vec<libc::c_int> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let mut cbuf = [0u64; 32];
        let mut iov = libc::iovec {
            iov_base: b"x".as_ptr().cast_mut().cast(),
            iov_len: 1,
        };
        // SAFETY: test-only hand-built msghdr over live local buffers (cbuf is 256 bytes,
        // enough for CMSG_SPACE of 9 ints), as in send_with_fd.
        unsafe {
            let mut msg: libc::msghdr = MaybeUninit::zeroed().assume_init();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = cbuf.as_mut_ptr().cast();
            msg.msg_controllen = cmsg_space(raws.len()) as _;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN((raws.len() * FD_BYTES) as libc::c_uint) as _;
            std::ptr::copy_nonoverlapping(
                raws.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(cmsg),
                raws.len() * FD_BYTES,
            );
            assert_eq!(libc::sendmsg(a.as_raw_fd(), &msg, 0), 1);
        }
        let mut buf = [0u8; 4];
        let mut got = Vec::new();
        let err = recv_with_fds(b.as_fd(), &mut buf, &mut got).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }
}
