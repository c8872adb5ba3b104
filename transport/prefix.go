package transport

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"
	"unicode/utf8"
)

// The prefix index protocol (PrefixProtocol). An agent opens one stream to
// every relay it joined and publishes there what its engine's KV cache
// holds, as block hashes (scheduler.PromptBlocks). Every message is a frame:
//
//	length  uvarint: bytes that follow (2 .. PrefixMaxFrame)
//	version byte: prefixVersion
//	type    byte: PrefixHello, PrefixSnapshot, ...
//	body    the type's fields, below; nothing may follow them
//
// Counts and sequence numbers are uvarints; block hashes are 8 bytes, little
// endian (they are uniformly random, so no variable-length code is shorter).
//
//	hello    agent -> relay, first: block tokens, bytes per token, max blocks,
//	         capacity in blocks (the relay refuses a hashing config unlike its own)
//	snapshot agent -> relay: seq, flags (1 first part, 2 last part), n, n hashes:
//	         every block held; a large snapshot comes in parts with consecutive seqs
//	delta    agent -> relay: seq, evicted count, added count, evicted hashes,
//	         added hashes (evictions apply first)
//	resync   relay -> agent: empty; send a snapshot
//	reject   relay -> agent: reason (UTF-8, at most 512 bytes); the relay
//	         ignores this agent's updates and closes the stream
//
// After the hello the agent sends a snapshot; every later message's seq is the
// previous one's plus one. A snapshot (its first part) may come at any time
// and restarts the picture: the agent sends one after any gap (a queue that
// overflowed, a resync). Anything else (a malformed frame, a delta before the
// first snapshot, a seq out of order) is a protocol violation.
const (
	prefixVersion byte = 1

	// PrefixMaxFrame bounds one frame's length (after the length prefix).
	PrefixMaxFrame = 256 << 10
	// PrefixMaxHashes is the most block hashes one frame carries: what fits
	// PrefixMaxFrame beside the largest header.
	PrefixMaxHashes = (PrefixMaxFrame - prefixMaxHeader) / 8
	// PrefixMaxConfig bounds the hello's numbers.
	PrefixMaxConfig = 1 << 30

	prefixMaxHeader = 2 + 3*binary.MaxVarintLen64 + 1
	prefixMaxReason = 512

	prefixFlagFirst = 1
	prefixFlagLast  = 2
)

// PrefixMsgType is the kind of a prefix index message.
type PrefixMsgType uint8

// Prefix index message types; see PrefixProtocol's framing above.
const (
	PrefixHello    PrefixMsgType = 1
	PrefixSnapshot PrefixMsgType = 2
	PrefixDelta    PrefixMsgType = 3
	PrefixResync   PrefixMsgType = 4
	PrefixReject   PrefixMsgType = 5
)

// String returns the type's name ("hello", "snapshot", ...).
func (t PrefixMsgType) String() string {
	switch t {
	case PrefixHello:
		return "hello"
	case PrefixSnapshot:
		return "snapshot"
	case PrefixDelta:
		return "delta"
	case PrefixResync:
		return "resync"
	case PrefixReject:
		return "reject"
	}
	return fmt.Sprintf("PrefixMsgType(%d)", uint8(t))
}

// Errors of the prefix index codec. Every decoding error wraps
// ErrPrefixMalformed; an announced length over PrefixMaxFrame is
// ErrPrefixTooLarge (which wraps ErrPrefixMalformed too).
var (
	ErrPrefixMalformed = errors.New("transport: malformed prefix index frame")
	ErrPrefixTooLarge  = fmt.Errorf("%w: frame too large", ErrPrefixMalformed)
)

// PrefixMsg is one message of the prefix index protocol. Only the fields of
// its Type are encoded; the zero value is not a valid message (no type).
// DecodePrefixMsg reuses the Added and Evicted slices' storage.
type PrefixMsg struct {
	Type PrefixMsgType
	// Seq numbers snapshot parts and deltas (see PrefixProtocol).
	Seq uint64
	// First and Last mark a snapshot's first and last part (both for a
	// snapshot in one frame).
	First, Last bool
	// Added are the hashes a delta adds, or a snapshot part's hashes.
	Added []uint64
	// Evicted are the hashes a delta removes.
	Evicted []uint64
	// BlockTokens, BytesPerToken and MaxBlocks are the agent's hashing
	// configuration (hello); CapacityBlocks its index's size in blocks.
	BlockTokens, BytesPerToken, MaxBlocks, CapacityBlocks int
	// Reason says why the relay rejected the publisher (reject).
	Reason string
}

// AppendPrefixFrame appends m as one frame (length prefix included) to dst.
// It fails for a message that cannot be framed: an unknown type, more than
// PrefixMaxHashes hashes, a hello number outside 0..PrefixMaxConfig or a
// reason longer than 512 bytes or not UTF-8.
func AppendPrefixFrame(dst []byte, m *PrefixMsg) ([]byte, error) {
	var hdr [prefixMaxHeader + 4*binary.MaxVarintLen64]byte
	b := append(hdr[:0], prefixVersion, byte(m.Type))
	var hashes [2][]uint64
	switch m.Type {
	case PrefixHello:
		for _, v := range []int{m.BlockTokens, m.BytesPerToken, m.MaxBlocks, m.CapacityBlocks} {
			if v < 0 || v > PrefixMaxConfig {
				return dst, fmt.Errorf("transport: prefix hello value %d out of range", v)
			}
			b = binary.AppendUvarint(b, uint64(v))
		}
	case PrefixSnapshot:
		if len(m.Evicted) > 0 {
			return dst, errors.New("transport: a prefix snapshot has no evictions")
		}
		var flags byte
		if m.First {
			flags |= prefixFlagFirst
		}
		if m.Last {
			flags |= prefixFlagLast
		}
		b = binary.AppendUvarint(b, m.Seq)
		b = append(b, flags)
		b = binary.AppendUvarint(b, uint64(len(m.Added)))
		hashes[0] = m.Added
	case PrefixDelta:
		b = binary.AppendUvarint(b, m.Seq)
		b = binary.AppendUvarint(b, uint64(len(m.Evicted)))
		b = binary.AppendUvarint(b, uint64(len(m.Added)))
		hashes[0], hashes[1] = m.Evicted, m.Added
	case PrefixResync:
	case PrefixReject:
		if len(m.Reason) > prefixMaxReason || !utf8.ValidString(m.Reason) {
			return dst, errors.New("transport: prefix reject reason too long or not UTF-8")
		}
		b = append(b, m.Reason...)
	default:
		return dst, fmt.Errorf("transport: unknown prefix message type %d", m.Type)
	}
	if n := len(hashes[0]) + len(hashes[1]); n > PrefixMaxHashes {
		return dst, fmt.Errorf("transport: %d hashes in one prefix frame, at most %d", n, PrefixMaxHashes)
	}
	size := len(b) + 8*(len(hashes[0])+len(hashes[1]))
	dst = binary.AppendUvarint(dst, uint64(size))
	dst = append(dst, b...)
	for _, hs := range hashes {
		for _, h := range hs {
			dst = binary.LittleEndian.AppendUint64(dst, h)
		}
	}
	return dst, nil
}

// DecodePrefixMsg decodes one frame's body (after its length prefix) into m,
// reusing m's slices. It never panics, allocates at most what the body's
// hashes need, and fails with an error wrapping ErrPrefixMalformed for
// anything AppendPrefixFrame would not produce.
func DecodePrefixMsg(body []byte, m *PrefixMsg) error {
	added, evicted := m.Added[:0], m.Evicted[:0]
	*m = PrefixMsg{Added: added, Evicted: evicted}
	if len(body) > PrefixMaxFrame {
		return ErrPrefixTooLarge
	}
	if len(body) < 2 {
		return fmt.Errorf("%w: truncated", ErrPrefixMalformed)
	}
	if body[0] != prefixVersion {
		return fmt.Errorf("%w: version %d", ErrPrefixMalformed, body[0])
	}
	m.Type = PrefixMsgType(body[1])
	d := wireDecoder{b: body[2:], bad: ErrPrefixMalformed}
	switch m.Type {
	case PrefixHello:
		m.BlockTokens = int(d.uvarint(PrefixMaxConfig))
		m.BytesPerToken = int(d.uvarint(PrefixMaxConfig))
		m.MaxBlocks = int(d.uvarint(PrefixMaxConfig))
		m.CapacityBlocks = int(d.uvarint(PrefixMaxConfig))
	case PrefixSnapshot:
		m.Seq = d.uvarint(^uint64(0))
		flags := d.byte()
		if flags&^(prefixFlagFirst|prefixFlagLast) != 0 {
			d.fail("snapshot flags %#x", flags)
		}
		m.First, m.Last = flags&prefixFlagFirst != 0, flags&prefixFlagLast != 0
		n := d.uvarint(PrefixMaxHashes)
		m.Added = d.hashes(added, n)
	case PrefixDelta:
		m.Seq = d.uvarint(^uint64(0))
		ne := d.uvarint(PrefixMaxHashes)
		na := d.uvarint(PrefixMaxHashes)
		if ne+na > PrefixMaxHashes {
			d.fail("%d hashes", ne+na)
		}
		m.Evicted = d.hashes(evicted, ne)
		m.Added = d.hashes(added, na)
	case PrefixResync:
	case PrefixReject:
		if len(d.b) > prefixMaxReason || !utf8.Valid(d.b) {
			d.fail("reject reason")
		} else {
			m.Reason = strings.Clone(string(d.b))
			d.b = nil
		}
	default:
		d.fail("unknown type %d", body[1])
	}
	if d.err == nil && len(d.b) > 0 {
		d.fail("%d bytes after the message", len(d.b))
	}
	if d.err != nil {
		*m = PrefixMsg{Added: added, Evicted: evicted}
		return d.err
	}
	return nil
}

func (d *wireDecoder) byte() byte {
	if d.err != nil {
		return 0
	}
	if len(d.b) == 0 {
		d.fail("truncated")
		return 0
	}
	c := d.b[0]
	d.b = d.b[1:]
	return c
}

func (d *wireDecoder) hashes(dst []uint64, n uint64) []uint64 {
	if d.err != nil {
		return dst
	}
	if uint64(len(d.b)) < 8*n {
		d.fail("%d hashes announced, %d bytes left", n, len(d.b))
		return dst
	}
	for i := uint64(0); i < n; i++ {
		dst = append(dst, binary.LittleEndian.Uint64(d.b[8*i:]))
	}
	d.b = d.b[8*n:]
	return dst
}

// PrefixReader reads prefix index frames from a stream, reusing one buffer.
// It is not safe for concurrent use.
type PrefixReader struct {
	r   *bufio.Reader
	buf []byte
}

// NewPrefixReader returns a reader of the frames on r.
func NewPrefixReader(r io.Reader) *PrefixReader {
	return &PrefixReader{r: bufio.NewReaderSize(r, 4096)}
}

// Next reads the next frame into m and returns its size on the wire (length
// prefix included). At the end of the stream between frames it returns
// io.EOF; a frame cut short is io.ErrUnexpectedEOF; an announced length
// over PrefixMaxFrame is ErrPrefixTooLarge, before any of the body is read.
func (pr *PrefixReader) Next(m *PrefixMsg) (int, error) {
	size, err := pr.length()
	if err != nil {
		return 0, err
	}
	if size > PrefixMaxFrame {
		return 0, fmt.Errorf("%w: %d bytes announced", ErrPrefixTooLarge, size)
	}
	if cap(pr.buf) < int(size) {
		pr.buf = make([]byte, size)
	}
	body := pr.buf[:size]
	if _, err := io.ReadFull(pr.r, body); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return 0, err
	}
	wire := int(size) + uvarintLen(size)
	return wire, DecodePrefixMsg(body, m)
}

// length reads a frame's length prefix: io.EOF before its first byte,
// io.ErrUnexpectedEOF inside it, ErrPrefixMalformed for an overlong one;
// other read errors as they come.
func (pr *PrefixReader) length() (uint64, error) {
	var v uint64
	for i := 0; i < binary.MaxVarintLen64; i++ {
		c, err := pr.r.ReadByte()
		if err != nil {
			if i > 0 && errors.Is(err, io.EOF) {
				return 0, io.ErrUnexpectedEOF
			}
			return 0, err
		}
		v |= uint64(c&0x7f) << (7 * i)
		if c < 0x80 {
			if i == binary.MaxVarintLen64-1 && c > 1 {
				break
			}
			return v, nil
		}
	}
	return 0, fmt.Errorf("%w: overlong length", ErrPrefixMalformed)
}

func uvarintLen(v uint64) int {
	n := 1
	for v >= 0x80 {
		v >>= 7
		n++
	}
	return n
}
