//! The HTTP/2 `:authority` the kubelet sends, made acceptable to h2.
//!
//! The kubelet's plugin watcher dials the registration socket with grpc-go
//! and the bare socket path, so grpc-go sends that path as `:authority`,
//! percent-encoded (`%2Fvar%2Flib%2Fkubelet%2F...`; older grpc-go: the raw
//! path). h2, under hyper and tonic, checks `:authority` with
//! `http::uri::Authority` while it parses the request head and resets such a
//! stream (`RST_STREAM PROTOCOL_ERROR`) before any service sees it: grpc-rust
//! issue #1876 (a tonic CSI driver under kubelet 1.28) and hyperium/h2
//! PR #487 ("Do not require authority for UNIX domain sockets", still open).
//! h2 0.4.20, hyper 1.12 and tonic 0.14.9 (the versions in `Cargo.lock`) have
//! no setting that relaxes the check.
//!
//! So the kit serves each Unix connection through [`ServerConn`], which
//! sits between the socket and tonic and rewrites the HEADERS of the client's
//! requests: an `:authority` that h2 would reject (exactly: that
//! `http::uri::Authority` does not parse, h2's own check) becomes `localhost`,
//! which is what the kubelet sends on `dra.sock`. Everything else passes
//! unchanged, and tonic serves the services as before.
//!
//! What is touched, and how little:
//! - The frame layer (RFC 9113 §4.1): 9-byte frame headers are read to find
//!   HEADERS and CONTINUATION frames; every other frame, and every byte the
//!   server sends, passes through untouched.
//! - The header block (RFC 7541) is decoded by `loona-hpack`, which keeps the
//!   client's dynamic table, and re-encoded as literals without indexing
//!   (§6.2.2), so the server's dynamic table stays empty and no state needs to
//!   be mirrored. Padding is dropped; END_STREAM and priority are kept; the new
//!   block is split into frames of at most 16 384 bytes (the smallest
//!   SETTINGS_MAX_FRAME_SIZE a peer may have, RFC 9113 §6.5.2).
//! - Input is bounded (one header block at most [`MAX_HEADER_BLOCK`] bytes)
//!   and anything malformed is an error that closes the connection, as h2
//!   would; nothing panics on any input (a property test feeds it arbitrary
//!   bytes).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The HTTP/2 client connection preface (RFC 9113 §3.4).
const PREFACE_LEN: usize = 24;
/// Frame header length.
const FRAME_HEADER: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// Largest frame payload written: the minimum SETTINGS_MAX_FRAME_SIZE.
const MAX_FRAME_OUT: usize = 16_384;
/// Largest header block accepted from a client (h2's own limit under hyper
/// is 16 KiB of decoded headers by default; the kubelet's are far smaller).
pub const MAX_HEADER_BLOCK: usize = 1 << 20;
/// The HPACK dynamic table size h2 advertises (the protocol default, which
/// h2 keeps unless configured otherwise; the kit does not configure it).
const HPACK_TABLE_SIZE: usize = 4096;

/// The `:authority` that replaces one h2 would reject.
pub const REPLACEMENT: &str = "localhost";

/// What to do with a request's `:authority`.
#[derive(Clone, Debug)]
pub(crate) enum Policy {
    /// Replace one that h2 rejects with [`REPLACEMENT`]; keep valid ones.
    Accept,
    /// Replace every one with this value (a client that dials as the kubelet:
    /// test support).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    Send(Vec<u8>),
}

#[derive(Debug)]
enum State {
    /// Bytes of the client preface still to pass.
    Preface(usize),
    /// Waiting for a frame header.
    Header,
    /// Bytes of a passed-through frame's payload still to pass.
    Pass(usize),
    /// A HEADERS or CONTINUATION frame payload of this many bytes.
    Block {
        len: usize,
        ty: u8,
        flags: u8,
        stream: u32,
    },
}

/// The first HEADERS frame of a header block still being collected.
#[derive(Debug)]
struct Open {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
}

/// Rewrites the client-to-server bytes of one HTTP/2 connection.
pub(crate) struct Rewriter {
    policy: Policy,
    state: State,
    /// Unconsumed input (a partial frame header or header frame payload).
    input: Vec<u8>,
    decoder: loona_hpack::Decoder<'static>,
    open: Option<Open>,
    block: Vec<u8>,
    /// Header blocks rewritten so far (a test observes it).
    #[cfg_attr(not(test), allow(dead_code))]
    rewritten: u64,
}

impl std::fmt::Debug for Rewriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rewriter")
            .field("policy", &self.policy)
            .field("state", &self.state)
            .field("rewritten", &self.rewritten)
            .finish_non_exhaustive()
    }
}

fn bad(what: impl Into<String>) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("HTTP/2 from client: {}", what.into()),
    )
}

/// RFC 7541 §5.1 integer with an `n`-bit prefix, first byte ORed with `mask`.
fn encode_int(mut v: usize, n: u8, mask: u8, out: &mut Vec<u8>) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(mask | v as u8);
        return;
    }
    out.push(mask | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128) as u8 | 0x80);
        v /= 128;
    }
    out.push(v as u8);
}

/// RFC 7541 §6.2.2 literal header field without indexing, new name, both
/// strings raw (no Huffman).
fn encode_literal(name: &[u8], value: &[u8], out: &mut Vec<u8>) {
    out.push(0);
    encode_int(name.len(), 7, 0, out);
    out.extend_from_slice(name);
    encode_int(value.len(), 7, 0, out);
    out.extend_from_slice(value);
}

fn frame_header(len: usize, ty: u8, flags: u8, stream: u32, out: &mut Vec<u8>) {
    let len = u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes();
    out.extend_from_slice(&len[1..]);
    out.push(ty);
    out.push(flags);
    out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
}

impl Rewriter {
    pub(crate) fn new(policy: Policy) -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(HPACK_TABLE_SIZE);
        Self {
            policy,
            state: State::Preface(PREFACE_LEN),
            input: Vec::new(),
            decoder,
            open: None,
            block: Vec::new(),
            rewritten: 0,
        }
    }

    /// Take `data` from the client and append what the server gets to `out`.
    ///
    /// # Errors
    /// Malformed frames or header blocks (the connection must be closed).
    pub(crate) fn feed(&mut self, data: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        let mut data = data;
        loop {
            match self.state {
                State::Preface(left) | State::Pass(left) => {
                    let n = left.min(data.len());
                    out.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    let left = left - n;
                    self.state = match (&self.state, left) {
                        (_, 0) => State::Header,
                        (State::Preface(_), l) => State::Preface(l),
                        (_, l) => State::Pass(l),
                    };
                    if data.is_empty() {
                        return Ok(());
                    }
                }
                State::Header => {
                    let need = FRAME_HEADER - self.input.len();
                    let n = need.min(data.len());
                    self.input.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    if self.input.len() < FRAME_HEADER {
                        return Ok(());
                    }
                    let h = std::mem::take(&mut self.input);
                    self.read_frame_header(&h, out)?;
                    if data.is_empty() && !matches!(self.state, State::Block { len: 0, .. }) {
                        return Ok(());
                    }
                }
                State::Block {
                    len,
                    ty,
                    flags,
                    stream,
                } => {
                    let n = (len - self.input.len()).min(data.len());
                    self.input.extend_from_slice(&data[..n]);
                    data = &data[n..];
                    if self.input.len() < len {
                        return Ok(());
                    }
                    let payload = std::mem::take(&mut self.input);
                    self.state = State::Header;
                    self.block_frame(&payload, ty, flags, stream, out)?;
                    if data.is_empty() {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// A whole frame header `h` read: the state for its payload (a header
    /// block fragment to collect, or bytes to pass on, the header with them).
    fn read_frame_header(&mut self, h: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        let len = usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
        let (ty, flags) = (h[3], h[4]);
        let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        if ty == TYPE_HEADERS || ty == TYPE_CONTINUATION {
            if self.block.len() + len > MAX_HEADER_BLOCK {
                return Err(bad(format!("header block over {MAX_HEADER_BLOCK} bytes")));
            }
            self.state = State::Block {
                len,
                ty,
                flags,
                stream,
            };
        } else if self.open.is_some() {
            return Err(bad(format!(
                "frame type {ty:#x} inside a header block (CONTINUATION expected)"
            )));
        } else {
            out.extend_from_slice(h);
            self.state = if len == 0 {
                State::Header
            } else {
                State::Pass(len)
            };
        }
        Ok(())
    }

    /// A HEADERS or CONTINUATION frame's `payload`: its fragment added to
    /// the open header block; once the block ends, rewritten and framed
    /// again into `out`.
    fn block_frame(
        &mut self,
        payload: &[u8],
        ty: u8,
        flags: u8,
        stream: u32,
        out: &mut Vec<u8>,
    ) -> io::Result<()> {
        let fragment = if ty == TYPE_HEADERS {
            self.open_block(payload, flags, stream)?
        } else {
            match &self.open {
                Some(o) if o.stream == stream => payload,
                _ => return Err(bad("CONTINUATION without its HEADERS")),
            }
        };
        self.block.extend_from_slice(fragment);
        if flags & FLAG_END_HEADERS == 0 {
            return Ok(());
        }
        let open = self.open.take().ok_or_else(|| bad("header block"))?;
        let block = std::mem::take(&mut self.block);
        let fields = self.rewrite_block(&block)?;
        self.rewritten += 1;
        write_block(&open, &fields, out);
        Ok(())
    }

    /// A HEADERS frame opens a header block: its padding and priority taken
    /// off (the priority kept for the frame written again); returns its
    /// fragment.
    fn open_block<'p>(
        &mut self,
        payload: &'p [u8],
        flags: u8,
        stream: u32,
    ) -> io::Result<&'p [u8]> {
        if self.open.is_some() {
            return Err(bad("HEADERS inside a header block"));
        }
        if stream == 0 {
            return Err(bad("HEADERS on stream 0"));
        }
        let mut p = payload;
        if flags & FLAG_PADDED != 0 {
            let (&pad, rest) = p.split_first().ok_or_else(|| bad("HEADERS padding"))?;
            let keep = rest
                .len()
                .checked_sub(usize::from(pad))
                .ok_or_else(|| bad("HEADERS padding longer than the frame"))?;
            p = &rest[..keep];
        }
        let priority = if flags & FLAG_PRIORITY != 0 {
            let (pri, rest) = p
                .split_first_chunk::<5>()
                .ok_or_else(|| bad("HEADERS priority"))?;
            p = rest;
            Some(*pri)
        } else {
            None
        };
        self.open = Some(Open {
            stream,
            end_stream: flags & FLAG_END_STREAM != 0,
            priority,
        });
        Ok(p)
    }

    /// A whole header block decoded, its `:authority` as the policy says,
    /// and encoded again as literal fields.
    fn rewrite_block(&mut self, block: &[u8]) -> io::Result<Vec<u8>> {
        let mut fields = Vec::new();
        let policy = &self.policy;
        self.decoder
            .decode_with_cb(block, |name, value| {
                let value = if name.as_ref() == b":authority" {
                    match policy {
                        Policy::Accept
                            if http::uri::Authority::try_from(value.as_ref()).is_ok() =>
                        {
                            value.into_owned()
                        }
                        Policy::Accept => REPLACEMENT.as_bytes().to_vec(),
                        Policy::Send(v) => v.clone(),
                    }
                } else {
                    value.into_owned()
                };
                encode_literal(&name, &value, &mut fields);
            })
            .map_err(|e| bad(format!("header block (HPACK): {e:?}")))?;
        Ok(fields)
    }
}

/// The header block `fields` of `open` framed again into `out`: HEADERS
/// (with its priority kept) and CONTINUATIONs.
fn write_block(open: &Open, fields: &[u8], out: &mut Vec<u8>) {
    let pri = open.priority.map_or(0, |_| 5);
    let first = fields.len().min(MAX_FRAME_OUT - pri);
    let mut fl = if open.end_stream { FLAG_END_STREAM } else { 0 };
    if open.priority.is_some() {
        fl |= FLAG_PRIORITY;
    }
    if first == fields.len() {
        fl |= FLAG_END_HEADERS;
    }
    frame_header(first + pri, TYPE_HEADERS, fl, open.stream, out);
    if let Some(p) = open.priority {
        out.extend_from_slice(&p);
    }
    out.extend_from_slice(&fields[..first]);
    let mut rest = &fields[first..];
    while !rest.is_empty() {
        let n = rest.len().min(MAX_FRAME_OUT);
        let fl = if n == rest.len() { FLAG_END_HEADERS } else { 0 };
        frame_header(n, TYPE_CONTINUATION, fl, open.stream, out);
        out.extend_from_slice(&rest[..n]);
        rest = &rest[n..];
    }
}

/// A server-side connection whose client requests pass through a
/// [`Rewriter`] with [`Policy::Accept`] before h2 reads them; writes pass
/// straight through.
#[derive(Debug)]
pub struct ServerConn<S> {
    inner: S,
    rw: Rewriter,
    out: Vec<u8>,
    pos: usize,
    eof: bool,
}

impl<S> ServerConn<S> {
    /// Wrap an accepted connection.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            rw: Rewriter::new(Policy::Accept),
            out: Vec::new(),
            pos: 0,
            eof: false,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ServerConn<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.pos < this.out.len() {
                let n = (this.out.len() - this.pos).min(buf.remaining());
                buf.put_slice(&this.out[this.pos..this.pos + n]);
                this.pos += n;
                if this.pos == this.out.len() {
                    this.out.clear();
                    this.pos = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut raw = [0u8; 8192];
            let mut rb = ReadBuf::new(&mut raw);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut rb))?;
            if rb.filled().is_empty() {
                this.eof = true;
            } else {
                this.rw.feed(rb.filled(), &mut this.out)?;
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for ServerConn<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for ServerConn<tokio::net::UnixStream> {
    type ConnectInfo = <tokio::net::UnixStream as tonic::transport::server::Connected>::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// A client-side connection whose request HEADERS pass through a
/// [`Rewriter`] with [`Policy::Send`] on their way out: a tonic client that
/// sends `:authority` as grpc-go sends it to a bare socket path (test
/// support; tonic itself only sends authorities that `http::Uri` parses).
#[cfg(feature = "testing")]
#[derive(Debug)]
pub struct ClientConn<S> {
    inner: S,
    rw: Rewriter,
    pending: Vec<u8>,
    pos: usize,
}

#[cfg(feature = "testing")]
impl<S> ClientConn<S> {
    /// Wrap a connection; every request will carry `authority`.
    pub fn new(inner: S, authority: &str) -> Self {
        Self {
            inner,
            rw: Rewriter::new(Policy::Send(authority.as_bytes().to_vec())),
            pending: Vec::new(),
            pos: 0,
        }
    }
}

#[cfg(feature = "testing")]
impl<S: AsyncWrite + Unpin> ClientConn<S> {
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.pos < self.pending.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.pending[self.pos..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.pos += n;
        }
        self.pending.clear();
        self.pos = 0;
        Poll::Ready(Ok(()))
    }
}

#[cfg(feature = "testing")]
impl<S: AsyncRead + Unpin> AsyncRead for ClientConn<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

#[cfg(feature = "testing")]
impl<S: AsyncWrite + Unpin> AsyncWrite for ClientConn<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.drain(cx))?;
        this.rw.feed(buf, &mut this.pending)?;
        // Accepted: what is left goes out on the next write or flush.
        let _ = this.drain(cx)?;
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.drain(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.drain(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    fn frame(ty: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        frame_header(payload.len(), ty, flags, stream, &mut v);
        v.extend_from_slice(payload);
        v
    }

    /// grpc-go's request head: `:authority` with incremental indexing and a
    /// Huffman-free literal, so the second request refers to it by index.
    fn request_block(enc: &mut loona_hpack::Encoder<'_>, authority: &[u8]) -> Vec<u8> {
        let h: [(&[u8], &[u8]); 6] = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/pluginregistration.Registration/GetInfo"),
            (b":authority", authority),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ];
        enc.encode(h)
    }

    fn decode_all(bytes: &[u8]) -> Vec<Vec<(Vec<u8>, Vec<u8>)>> {
        // Walk the rewritten stream as h2 would: frames after the preface.
        assert_eq!(&bytes[..24], PREFACE);
        let mut p = &bytes[24..];
        let mut dec = loona_hpack::Decoder::new();
        let mut blocks = Vec::new();
        let mut block = Vec::new();
        while !p.is_empty() {
            let len = usize::from(p[0]) << 16 | usize::from(p[1]) << 8 | usize::from(p[2]);
            let (ty, flags) = (p[3], p[4]);
            assert!(len <= MAX_FRAME_OUT || ty != TYPE_HEADERS);
            let payload = &p[9..9 + len];
            if ty == TYPE_HEADERS || ty == TYPE_CONTINUATION {
                assert_eq!(flags & FLAG_PADDED, 0);
                let skip = if flags & FLAG_PRIORITY != 0 { 5 } else { 0 };
                block.extend_from_slice(&payload[skip..]);
                if flags & FLAG_END_HEADERS != 0 {
                    blocks.push(dec.decode(&block).unwrap());
                    block.clear();
                }
            }
            p = &p[9 + len..];
        }
        blocks
    }

    fn authority_of(h: &[(Vec<u8>, Vec<u8>)]) -> String {
        let (_, v) = h.iter().find(|(n, _)| n == b":authority").unwrap();
        String::from_utf8(v.clone()).unwrap()
    }

    fn stream(authority: &[u8]) -> Vec<u8> {
        let mut enc = loona_hpack::Encoder::new();
        let mut s = PREFACE.to_vec();
        s.extend(frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100])); // SETTINGS
        let b1 = request_block(&mut enc, authority);
        // First request split over HEADERS (padded, priority) + CONTINUATION.
        let (a, b) = b1.split_at(b1.len() / 2);
        let mut h = vec![3u8];
        h.extend_from_slice(&[0, 0, 0, 0, 15]);
        h.extend_from_slice(a);
        h.extend_from_slice(&[0, 0, 0]);
        s.extend(frame(TYPE_HEADERS, FLAG_PADDED | FLAG_PRIORITY, 1, &h));
        s.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, b));
        s.extend(frame(0x0, FLAG_END_STREAM, 1, &[0, 0, 0, 0, 0]));
        // Second request: the authority comes from the dynamic table.
        let b2 = request_block(&mut enc, authority);
        s.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 3, &b2));
        s
    }

    #[test]
    fn an_authority_h2_rejects_becomes_localhost_on_every_request() {
        for auth in [
            &b"%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.carve.dev-reg.sock"[..],
            b"/var/lib/kubelet/plugins_registry/gpu.carve.dev-reg.sock",
        ] {
            let input = stream(auth);
            let mut whole = Vec::new();
            let mut rw = Rewriter::new(Policy::Accept);
            rw.feed(&input, &mut whole).unwrap();
            assert_eq!(rw.rewritten, 2);
            let blocks = decode_all(&whole);
            assert_eq!(blocks.len(), 2);
            for b in &blocks {
                assert_eq!(authority_of(b), "localhost");
                assert_eq!(b[2].1, b"/pluginregistration.Registration/GetInfo");
                assert_eq!(b.len(), 6);
            }
            // Byte by byte gives the same stream.
            let mut bytewise = Vec::new();
            let mut rw = Rewriter::new(Policy::Accept);
            for b in &input {
                rw.feed(std::slice::from_ref(b), &mut bytewise).unwrap();
            }
            assert_eq!(bytewise, whole);
        }
    }

    #[test]
    fn a_valid_authority_is_kept_and_the_client_policy_replaces_it() {
        let mut out = Vec::new();
        Rewriter::new(Policy::Accept)
            .feed(&stream(b"localhost:50051"), &mut out)
            .unwrap();
        for b in decode_all(&out) {
            assert_eq!(authority_of(&b), "localhost:50051");
        }
        let mut out = Vec::new();
        Rewriter::new(Policy::Send(b"%2Fx.sock".to_vec()))
            .feed(&stream(b"localhost"), &mut out)
            .unwrap();
        for b in decode_all(&out) {
            assert_eq!(authority_of(&b), "%2Fx.sock");
        }
    }

    #[test]
    fn a_large_header_block_is_split_into_continuations() {
        let mut enc = loona_hpack::Encoder::new();
        let big = vec![b'a'; 40_000];
        let h: [(&[u8], &[u8]); 3] = [
            (b":method", b"POST"),
            (b":authority", b"/x.sock"),
            (b"x-big", &big),
        ];
        let block = enc.encode(h);
        let mut input = PREFACE.to_vec();
        let mut rest = &block[..];
        let mut first = true;
        while !rest.is_empty() {
            let n = rest.len().min(16_000);
            let end = if n == rest.len() { FLAG_END_HEADERS } else { 0 };
            let ty = if first {
                TYPE_HEADERS
            } else {
                TYPE_CONTINUATION
            };
            input.extend(frame(ty, end, 5, &rest[..n]));
            rest = &rest[n..];
            first = false;
        }
        let mut out = Vec::new();
        Rewriter::new(Policy::Accept)
            .feed(&input, &mut out)
            .unwrap();
        let blocks = decode_all(&out);
        assert_eq!(authority_of(&blocks[0]), "localhost");
        assert_eq!(blocks[0][2].1, big);
    }

    #[test]
    fn malformed_input_is_an_error_naming_it() {
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (
                frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, &[0x82]),
                "CONTINUATION",
            ),
            (
                frame(TYPE_HEADERS, FLAG_END_HEADERS, 0, &[0x82]),
                "stream 0",
            ),
            (
                frame(TYPE_HEADERS, FLAG_PADDED | FLAG_END_HEADERS, 1, &[9, 0x82]),
                "padding",
            ),
            (frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &[0xff]), "HPACK"),
            (
                [frame(TYPE_HEADERS, 0, 1, &[0x82]), frame(0x0, 0, 1, &[])].concat(),
                "inside a header block",
            ),
            (
                frame(TYPE_HEADERS, 0, 1, &vec![0; MAX_HEADER_BLOCK + 1]),
                "header block over",
            ),
        ];
        for (f, msg) in cases {
            let mut input = PREFACE.to_vec();
            input.extend(f);
            let e = Rewriter::new(Policy::Accept)
                .feed(&input, &mut Vec::new())
                .unwrap_err();
            assert!(e.to_string().contains(msg), "{e} lacks {msg}");
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        use proptest::prelude::*;
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
            cases: 2000,
            ..ProptestConfig::default()
        });
        // Valid prefix then arbitrary frames, fed in arbitrary chunks.
        let strat = (
            proptest::collection::vec(
                (
                    any::<u8>(),
                    any::<u8>(),
                    0u32..4,
                    proptest::collection::vec(any::<u8>(), 0..64),
                ),
                0..8,
            ),
            1usize..40,
        );
        runner
            .run(&strat, |(frames, chunk)| {
                let mut input = PREFACE.to_vec();
                for (ty, flags, stream, payload) in frames {
                    input.extend(frame(ty % 12, flags, stream, &payload));
                }
                let mut rw = Rewriter::new(Policy::Accept);
                let mut out = Vec::new();
                for c in input.chunks(chunk) {
                    if rw.feed(c, &mut out).is_err() {
                        break;
                    }
                }
                Ok(())
            })
            .unwrap();
        let raw = proptest::collection::vec(any::<u8>(), 0..512);
        runner
            .run(&raw, |bytes| {
                let _ = Rewriter::new(Policy::Accept).feed(&bytes, &mut Vec::new());
                Ok(())
            })
            .unwrap();
    }
}
