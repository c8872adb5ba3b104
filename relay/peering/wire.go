package peering

import (
	"encoding/binary"
	"io"
	"sync/atomic"

	"github.com/computeflux/computeflux/relay/ledger"
	"github.com/computeflux/computeflux/scheduler"
)

// encodeBindings encodes the longest prefix of bs that fits about limit
// bytes (at least one binding) and returns it with the number encoded:
//
//	count uvarint, then per binding: key (uvarint length, bytes),
//	endpoint (uvarint length, bytes), gen uvarint, since varint (Unix ns),
//	last - since uvarint
func encodeBindings(bs []scheduler.Binding, limit int) ([]byte, int) {
	n := 0
	size := 0
	for n < len(bs) && (n == 0 || size+len(bs[n].Key)+len(bs[n].Endpoint)+32 <= limit) {
		size += len(bs[n].Key) + len(bs[n].Endpoint) + 32
		n++
	}
	buf := make([]byte, 0, size+binary.MaxVarintLen64)
	buf = binary.AppendUvarint(buf, uint64(n))
	for _, b := range bs[:n] {
		buf = binary.AppendUvarint(buf, uint64(len(b.Key)))
		buf = append(buf, b.Key...)
		buf = binary.AppendUvarint(buf, uint64(len(b.Endpoint)))
		buf = append(buf, b.Endpoint...)
		buf = binary.AppendUvarint(buf, uint64(b.Gen))
		buf = binary.AppendVarint(buf, b.Since)
		buf = binary.AppendUvarint(buf, uint64(max(b.Last-b.Since, 0)))
	}
	return buf, n
}

// encodeSpent encodes a prefix of cs (at least one entry, when any) of
// about limit bytes as a spending frame's body, and returns how many it
// took: a count, then per client its name, day, month, day's and month's
// tokens and month's cost.
func encodeSpent(cs []ledger.ClientSpent, limit int) ([]byte, int) {
	n, size := 0, 0
	for n < len(cs) && (n == 0 || size+len(cs[n].Client)+48 <= limit) {
		size += len(cs[n].Client) + 48
		n++
	}
	buf := make([]byte, 0, size+binary.MaxVarintLen64)
	buf = binary.AppendUvarint(buf, uint64(n))
	for _, c := range cs[:n] {
		buf = binary.AppendUvarint(buf, uint64(len(c.Client)))
		buf = append(buf, c.Client...)
		buf = binary.AppendVarint(buf, c.Day)
		buf = binary.AppendVarint(buf, int64(c.Month))
		buf = binary.AppendUvarint(buf, uint64(max(c.DayTokens, 0)))
		buf = binary.AppendUvarint(buf, uint64(max(c.MonthTokens, 0)))
		buf = binary.AppendUvarint(buf, uint64(max(c.MonthCost, 0)))
	}
	return buf, n
}

// maxPeerSpent bounds each count in a spending report, so that sums of
// reports cannot overflow.
const maxPeerSpent = 1 << 50

// decodeSpent decodes encodeSpent's format, checking every bound.
func decodeSpent(buf []byte) ([]ledger.ClientSpent, error) {
	count, k := binary.Uvarint(buf)
	if k <= 0 || count > uint64(len(buf)) {
		return nil, errPeerFrame
	}
	buf = buf[k:]
	out := make([]ledger.ClientSpent, 0, count)
	for range count {
		n, k := binary.Uvarint(buf)
		if k <= 0 || n == 0 || n > maxPeerClient || n > uint64(len(buf)-k) {
			return nil, errPeerFrame
		}
		c := ledger.ClientSpent{Client: string(buf[k : k+int(n)])}
		buf = buf[k+int(n):]
		var vals [5]int64
		for i := range vals {
			var v int64
			if i < 2 {
				v, k = binary.Varint(buf)
			} else {
				var u uint64
				u, k = binary.Uvarint(buf)
				if u > maxPeerSpent {
					return nil, errPeerFrame
				}
				v = int64(u)
			}
			if k <= 0 || v < 0 || v > maxPeerSpent {
				return nil, errPeerFrame
			}
			vals[i] = v
			buf = buf[k:]
		}
		if vals[1] > 1<<31-1 {
			return nil, errPeerFrame
		}
		c.Day, c.Month = vals[0], int32(vals[1])
		c.DayTokens, c.MonthTokens, c.MonthCost = vals[2], vals[3], ledger.Money(vals[4])
		out = append(out, c)
	}
	if len(buf) != 0 {
		return nil, errPeerFrame
	}
	return out, nil
}

// decodeBindings decodes encodeBindings' format, checking every bound.
func decodeBindings(buf []byte) ([]scheduler.Binding, error) {
	count, k := binary.Uvarint(buf)
	if k <= 0 || count > uint64(len(buf)) {
		return nil, errPeerFrame
	}
	buf = buf[k:]
	str := func(limit int) (string, bool) {
		n, k := binary.Uvarint(buf)
		if k <= 0 || n == 0 || n > uint64(limit) || n > uint64(len(buf)-k) {
			return "", false
		}
		s := string(buf[k : k+int(n)])
		buf = buf[k+int(n):]
		return s, true
	}
	out := make([]scheduler.Binding, 0, count)
	for range count {
		var b scheduler.Binding
		var ok bool
		if b.Key, ok = str(maxPeerKey); !ok {
			return nil, errPeerFrame
		}
		if b.Endpoint, ok = str(maxPeerEndpoint); !ok {
			return nil, errPeerFrame
		}
		gen, k := binary.Uvarint(buf)
		if k <= 0 || gen == 0 || gen > 1<<32-1 {
			return nil, errPeerFrame
		}
		buf = buf[k:]
		since, k := binary.Varint(buf)
		if k <= 0 {
			return nil, errPeerFrame
		}
		buf = buf[k:]
		d, k := binary.Uvarint(buf)
		if k <= 0 || d > 1<<62 || since > 1<<62 || since < 0 {
			return nil, errPeerFrame
		}
		buf = buf[k:]
		b.Gen, b.Since, b.Last = uint32(gen), since, since+int64(d)
		out = append(out, b)
	}
	if len(buf) != 0 {
		return nil, errPeerFrame
	}
	return out, nil
}

type countingWriter struct {
	w io.Writer
	n *atomic.Uint64
}

func (c *countingWriter) Write(b []byte) (int, error) {
	n, err := c.w.Write(b)
	c.n.Add(uint64(n))
	return n, err
}

type countingReader struct {
	r io.Reader
	n *atomic.Uint64
}

func (c *countingReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.n.Add(uint64(n))
	return n, err
}
