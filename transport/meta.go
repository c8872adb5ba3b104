package transport

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
)

// MetaMaxSize is the largest encoded NodeMeta memberlist carries (its own
// hard limit on node metadata).
const MetaMaxSize = 512

// metaVersion is the first byte of every encoding. Fields added later are
// appended after the version-1 fields, which older decoders ignore; a change
// to an existing field needs a new version byte.
const metaVersion = 1

// metaMaxString bounds the agent name and each model name on the wire.
const metaMaxString = 255

// metaMaxInt bounds the counters so that a decoded value always fits an int
// on every platform.
const metaMaxInt = math.MaxInt32

const (
	metaFlagRoleMask    = 0x03
	metaFlagDraining    = 0x04
	metaFlagUnavailable = 0x08
	metaFlagDigest      = 0x10 // models sent as count + digest only
	metaFlagLoadUnknown = 0x20 // Running, Waiting and KVCacheUsage not known
)

// ErrMetaTooLarge is returned by EncodeMeta when the metadata does not fit the
// limit even with the model list replaced by its digest.
var ErrMetaTooLarge = errors.New("transport: node metadata too large")

// ErrMetaVersion is returned by DecodeMeta for an encoding of an unknown version.
var ErrMetaVersion = errors.New("transport: unknown node metadata version")

// NodeRole says what a gossip member is. The zero value is NodeRoleUnknown.
type NodeRole uint8

// Node roles carried in NodeMeta.
const (
	NodeRoleUnknown NodeRole = 0
	NodeRoleRelay   NodeRole = 1
	NodeRoleAgent   NodeRole = 2
)

// String returns "relay", "agent" or "unknown".
func (r NodeRole) String() string {
	switch r {
	case NodeRoleRelay:
		return "relay"
	case NodeRoleAgent:
		return "agent"
	default:
		return "unknown"
	}
}

// NodeMeta is the health a member publishes in its memberlist metadata. The
// zero value is a member of unknown role with no data.
type NodeMeta struct {
	Role NodeRole
	// Name is the agent's name (at most 255 bytes); empty for relays.
	Name string
	// Models are the model IDs served, sorted and de-duplicated by
	// EncodeMeta. After DecodeMeta it is nil when ModelsTruncated is set.
	Models []string
	// ModelCount is the number of models; set by DecodeMeta (EncodeMeta
	// derives it from Models).
	ModelCount int
	// ModelsDigest identifies the model list (see ModelsDigest); set by
	// DecodeMeta in both modes, ignored by EncodeMeta.
	ModelsDigest [8]byte
	// ModelsTruncated is set by DecodeMeta when the list did not fit and only
	// its count and digest were sent: fetch the full list over the join
	// registration and compare its ModelsDigest.
	ModelsTruncated bool
	// Capacity is the agent's maximum concurrent requests; 0 = unlimited.
	Capacity int
	// InFlight is the requests the agent is serving now.
	InFlight int
	// Running and Waiting are the engine's running and queued requests, read
	// from its own metrics; 0 when the engine does not report them.
	Running, Waiting int
	// KVCacheUsage is the engine's KV-cache usage in 0..1 (0 = no data);
	// carried with a resolution of 1/10000.
	KVCacheUsage float64
	// Draining is set when the member takes no new requests.
	Draining bool
	// Unavailable is set when the agent cannot reach its engine.
	Unavailable bool
	// LoadUnknown is set when the agent has no current figures of its
	// engine's load: the engine reports none, or its last good /metrics
	// read is too old. Running, Waiting and KVCacheUsage are then 0 and
	// mean nothing; InFlight still holds. Decoders older than the flag
	// ignore it and see zeros, which they take as "no data" as well.
	LoadUnknown bool
	// Seq grows with every published change; set by Gossip.
	Seq uint64
	// Panics counts the request handlers' panics the member's servers
	// recovered since it started (see ServerLog). Appended to the version-1
	// fields: 0 from a member that predates it.
	Panics uint64
}

// ModelsDigest returns the digest carried in place of a model list that does
// not fit: the first 8 bytes of SHA-256 over the sorted, de-duplicated
// names, each followed by a newline.
func ModelsDigest(models []string) [8]byte {
	h := sha256.New()
	for _, m := range normalizeModels(models) {
		h.Write([]byte(m))
		h.Write([]byte{'\n'})
	}
	var d [8]byte
	copy(d[:], h.Sum(nil))
	return d
}

func normalizeModels(models []string) []string {
	out := slices.Clone(models)
	slices.Sort(out)
	return slices.Compact(out)
}

// EncodeMeta encodes m in at most limit bytes (0 or more than MetaMaxSize means
// MetaMaxSize). When the model list does not fit, or a model name is longer
// than 255 bytes, only its count and digest are sent. The encoding is
// deterministic. It fails with ErrMetaTooLarge when even that does not fit,
// and for a name longer than 255 bytes or a negative counter.
func EncodeMeta(m NodeMeta, limit int) ([]byte, error) {
	if limit <= 0 || limit > MetaMaxSize {
		limit = MetaMaxSize
	}
	if len(m.Name) > metaMaxString {
		return nil, fmt.Errorf("%w: name is %d bytes, at most %d", ErrMetaTooLarge, len(m.Name), metaMaxString)
	}
	if m.Role > 3 {
		return nil, fmt.Errorf("transport: node role %d out of range", m.Role)
	}
	for _, v := range []int{m.Capacity, m.InFlight, m.Running, m.Waiting} {
		if v < 0 || v > metaMaxInt {
			return nil, fmt.Errorf("transport: node metadata counter %d out of range", v)
		}
	}
	models := normalizeModels(m.Models)
	fits := true
	for _, s := range models {
		if len(s) > metaMaxString {
			fits = false
		}
	}
	if fits {
		if b := appendMeta(nil, m, models, false); len(b) <= limit {
			return b, nil
		}
	}
	b := appendMeta(nil, m, models, true)
	if len(b) > limit {
		return nil, fmt.Errorf("%w: %d bytes, limit %d", ErrMetaTooLarge, len(b), limit)
	}
	return b, nil
}

func appendMeta(b []byte, m NodeMeta, models []string, digest bool) []byte {
	flags := byte(m.Role) & metaFlagRoleMask
	if m.Draining {
		flags |= metaFlagDraining
	}
	if m.Unavailable {
		flags |= metaFlagUnavailable
	}
	if m.LoadUnknown {
		flags |= metaFlagLoadUnknown
	}
	if digest {
		flags |= metaFlagDigest
	}
	b = append(b, metaVersion, flags)
	b = binary.AppendUvarint(b, m.Seq)
	b = binary.AppendUvarint(b, uint64(len(m.Name)))
	b = append(b, m.Name...)
	for _, v := range []int{m.Capacity, m.InFlight, m.Running, m.Waiting} {
		b = binary.AppendUvarint(b, uint64(v))
	}
	b = binary.BigEndian.AppendUint16(b, kvToWire(m.KVCacheUsage))
	b = binary.AppendUvarint(b, uint64(len(models)))
	if digest {
		d := ModelsDigest(models)
		b = append(b, d[:]...)
		return binary.AppendUvarint(b, m.Panics)
	}
	for _, s := range models {
		b = binary.AppendUvarint(b, uint64(len(s)))
		b = append(b, s...)
	}
	return binary.AppendUvarint(b, m.Panics)
}

func kvToWire(f float64) uint16 {
	switch {
	case math.IsNaN(f) || f <= 0:
		return 0
	case f >= 1:
		return 10000
	default:
		return uint16(math.Round(f * 10000))
	}
}

// DecodeMeta decodes an encoding made by EncodeMeta. Bytes after the fields it
// knows are ignored (later versions append fields). It never panics on
// arbitrary input.
func DecodeMeta(b []byte) (NodeMeta, error) {
	var m NodeMeta
	if len(b) > MetaMaxSize {
		return m, fmt.Errorf("%w: %d bytes", ErrMetaTooLarge, len(b))
	}
	if len(b) < 2 {
		return m, errors.New("transport: node metadata truncated")
	}
	if b[0] != metaVersion {
		return m, fmt.Errorf("%w: %d", ErrMetaVersion, b[0])
	}
	flags := b[1]
	d := wireDecoder{b: b[2:], bad: errMetaMalformed}
	m.Role = NodeRole(flags & metaFlagRoleMask)
	m.Draining = flags&metaFlagDraining != 0
	m.Unavailable = flags&metaFlagUnavailable != 0
	m.LoadUnknown = flags&metaFlagLoadUnknown != 0
	m.ModelsTruncated = flags&metaFlagDigest != 0
	m.Seq = d.uvarint(math.MaxUint64)
	m.Name = d.str()
	m.Capacity = int(d.uvarint(metaMaxInt))
	m.InFlight = int(d.uvarint(metaMaxInt))
	m.Running = int(d.uvarint(metaMaxInt))
	m.Waiting = int(d.uvarint(metaMaxInt))
	kv := d.bytes(2)
	if d.err == nil {
		w := binary.BigEndian.Uint16(kv)
		if w > 10000 {
			d.fail("KV-cache usage %d out of range", w)
		}
		m.KVCacheUsage = float64(w) / 10000
	}
	maxModels := uint64(len(b)) // each listed model takes at least one byte
	if m.ModelsTruncated {
		maxModels = metaMaxInt
	}
	n := d.uvarint(maxModels)
	m.ModelCount = int(n)
	if m.ModelsTruncated {
		copy(m.ModelsDigest[:], d.bytes(8))
	} else if d.err == nil {
		m.Models = make([]string, 0, n)
		for i := uint64(0); i < n && d.err == nil; i++ {
			s := d.str()
			if d.err == nil && len(m.Models) > 0 && s <= m.Models[len(m.Models)-1] {
				d.fail("model names not sorted and unique")
			}
			m.Models = append(m.Models, s)
		}
		m.ModelsDigest = ModelsDigest(m.Models)
	}
	if d.err == nil && len(d.b) > 0 {
		m.Panics = d.uvarint(math.MaxUint64)
	}
	if d.err != nil {
		return NodeMeta{}, d.err
	}
	return m, nil
}

// errMetaMalformed prefixes every node metadata decoding error.
var errMetaMalformed = errors.New("transport: node metadata")

// wireDecoder reads the varint-framed fields shared by the node metadata and
// prefix index encodings. The first failure sticks: later reads return zero
// values and d.err keeps that first error, wrapped in bad.
type wireDecoder struct {
	b   []byte
	err error
	bad error
}

func (d *wireDecoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: "+format, append([]any{d.bad}, args...)...)
	}
}

func (d *wireDecoder) uvarint(max uint64) uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.fail("bad varint")
		return 0
	}
	if v > max {
		d.fail("value %d out of range", v)
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *wireDecoder) bytes(n int) []byte {
	if d.err != nil {
		return nil
	}
	if len(d.b) < n {
		d.fail("truncated")
		return nil
	}
	v := d.b[:n]
	d.b = d.b[n:]
	return v
}

func (d *wireDecoder) str() string {
	n := d.uvarint(metaMaxString)
	return strings.Clone(string(d.bytes(int(n))))
}

// metaSignificant reports whether next differs from prev enough to publish at
// once: any change of identity, models, capacity, flags or panics, a load change of
// at least 2 requests or 20%, or a KV-cache usage change of 0.05 or more.
// Smaller changes wait for the periodic refresh.
func metaSignificant(prev, next NodeMeta) bool {
	if prev.Role != next.Role || prev.Name != next.Name || prev.Capacity != next.Capacity ||
		prev.Draining != next.Draining || prev.Unavailable != next.Unavailable ||
		prev.LoadUnknown != next.LoadUnknown || prev.Panics != next.Panics ||
		!slices.Equal(normalizeModels(prev.Models), normalizeModels(next.Models)) {
		return true
	}
	load := func(a, b int) bool {
		d := a - b
		if d < 0 {
			d = -d
		}
		return d >= 2 || (d > 0 && float64(d) >= 0.2*float64(max(a, b)))
	}
	if load(prev.InFlight, next.InFlight) || load(prev.Running, next.Running) || load(prev.Waiting, next.Waiting) {
		return true
	}
	return math.Abs(prev.KVCacheUsage-next.KVCacheUsage) >= 0.05
}

// metaEqual reports whether a and b publish the same data (Seq aside).
func metaEqual(a, b NodeMeta) bool {
	return a.Role == b.Role && a.Name == b.Name && a.Capacity == b.Capacity &&
		a.InFlight == b.InFlight && a.Running == b.Running && a.Waiting == b.Waiting &&
		kvToWire(a.KVCacheUsage) == kvToWire(b.KVCacheUsage) && a.Draining == b.Draining &&
		a.Unavailable == b.Unavailable && a.LoadUnknown == b.LoadUnknown && slices.Equal(normalizeModels(a.Models), normalizeModels(b.Models))
}
