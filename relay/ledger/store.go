package ledger

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"
)

// Resolution is a row's period: an hour or a day.
type Resolution uint8

// The resolutions rows are kept at.
const (
	Hourly Resolution = iota + 1
	Daily
)

// Row is one stored row: a kind's entity (Name) and Model over one period.
type Row struct {
	Kind Kind
	Res  Resolution
	// Period is the UTC hour or day number.
	Period int64
	Name   string
	Model  string
	Counts
}

// Store keeps the ledger's rows. The ledger calls it from its flusher and
// from queries, concurrently; implementations must allow that.
type Store interface {
	// Seq returns the number of the last batch Apply applied; 0 for none.
	Seq() (uint64, error)
	// Apply adds deltas to their hourly rows and to the daily rows that
	// contain them, and records seq as applied, in one atomic step. A seq
	// not above the last applied one changes nothing and returns false:
	// that batch is already in.
	Apply(seq uint64, deltas []Delta) (applied bool, err error)
	// Scan calls fn with every row at res whose period is in [from, to).
	Scan(res Resolution, from, to int64, fn func(Row)) error
	// Seal packs the hourly rows of hours before hour, and the daily rows
	// of days before its day, for keeping: later Applies to them still
	// count. A store may keep open rows in a form cheap to update and
	// sealed rows in one cheap to keep.
	Seal(hour int64) error
	// Prune deletes hourly rows before hour and daily rows before day.
	Prune(hour, day int64) error
	// Claim records owner as the identity of agent name, unless another
	// owner claimed the name first, and returns the name's owner ("" when
	// the name is unclaimed and no more claims fit).
	Claim(agent, owner string) (string, error)
	// Close releases the store.
	Close() error
}

// Bucket names and meta keys of the bbolt file.
var (
	bucketMeta       = []byte("meta")
	bucketIDs        = []byte("ids")         // 4-byte id -> name
	bucketHourly     = []byte("hourly")      // sealed hours, packed
	bucketDaily      = []byte("daily")       // sealed days, packed
	bucketHourlyOpen = []byte("hourly-open") // the hours Apply updates
	bucketDailyOpen  = []byte("daily-open")  // the days Apply updates
	bucketOwners     = []byte("owners")      // agent name -> the peer ID that first served under it
	keySeq           = []byte("seq")
	keyVersion       = []byte("version")
)

// fileVersion is the layout of the file; Open refuses another.
const fileVersion = 1

// sealedFill fills sealed pages full: Seal appends whole periods in key
// order after every older one, so a sealed page is not split again. (Open
// rows are inserted in no order, so their buckets keep bbolt's half-full
// pages; they hold a day at most.)
const sealedFill = 1.0

// BoltStore is the Store in one bbolt file. Row keys are the period (4
// bytes, big-endian), the kind, and the name's and the model's ids
// (uvarints) from a dictionary kept in the same file; values are the
// counts as uvarints (serving time in microseconds). Apply updates rows in
// open buckets; Seal moves closed periods into packed buckets in key
// order, so a month of hours costs about the rows' own size on disk. After any failed
// operation it closes the file and opens it afresh on the next call, so
// what a failed commit left is read from the disk, not assumed.
type BoltStore struct {
	path     string
	maxNames int
	maxBytes int
	noSync   bool

	mu     sync.RWMutex // guards db and the dictionary; a writer holds it for Apply and Prune
	db     *bolt.DB
	ids    map[string]uint32
	names  []string // by id; "" for ids not used
	owners int      // claims in bucketOwners
}

// OpenBolt returns the store of the file at path, created if missing,
// keeping at most maxNames distinct names (a name past that is stored as
// Other) and growing the file to at most maxBytes (0: unbounded). The file
// is opened here and again after any failure; an error here leaves the
// store usable, to be tried again.
func OpenBolt(path string, maxNames, maxBytes int) (*BoltStore, error) {
	s := &BoltStore{path: path, maxNames: maxNames, maxBytes: maxBytes}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s, s.open()
}

// open opens the file and loads the dictionary. s.mu is held.
func (s *BoltStore) open() (err error) {
	if s.db != nil {
		return nil
	}
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("ledger file %s is corrupt: %v", s.path, p)
		}
		if err != nil && s.db != nil {
			_ = s.db.Close()
			s.db = nil
		}
	}()
	if dir := filepath.Dir(s.path); dir != "" {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return fmt.Errorf("ledger file: %w", err)
		}
	}
	db, err := bolt.Open(s.path, 0o600, &bolt.Options{
		Timeout:      time.Second, // another process holds the file: fail, do not wait forever
		FreelistType: bolt.FreelistMapType,
		MaxSize:      s.maxBytes,
		NoSync:       s.noSync,
	})
	if err != nil {
		if errors.Is(err, bolterrors.ErrTimeout) {
			err = errors.New("another process holds the file")
		}
		return fmt.Errorf("ledger file %s: %w", s.path, err)
	}
	s.db = db
	ids := map[string]uint32{}
	var owners int
	var names []string
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketMeta, bucketIDs, bucketHourly, bucketDaily, bucketHourlyOpen, bucketDailyOpen, bucketOwners} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		meta := tx.Bucket(bucketMeta)
		switch v := meta.Get(keyVersion); {
		case v == nil:
			if err := meta.Put(keyVersion, binary.AppendUvarint(nil, fileVersion)); err != nil {
				return err
			}
		default:
			if n, k := binary.Uvarint(v); k <= 0 || n != fileVersion {
				return fmt.Errorf("layout version %d, want %d", n, fileVersion)
			}
		}
		owners = tx.Bucket(bucketOwners).Stats().KeyN
		return tx.Bucket(bucketIDs).ForEach(func(k, v []byte) error {
			if len(k) != 4 {
				return errors.New("a name id is not 4 bytes")
			}
			id := binary.BigEndian.Uint32(k)
			for int(id) >= len(names) {
				names = append(names, "")
			}
			names[id] = string(v)
			ids[string(v)] = id
			return nil
		})
	})
	if err != nil {
		return fmt.Errorf("ledger file %s: %w", s.path, err)
	}
	s.ids, s.names, s.owners = ids, names, owners
	return nil
}

// fail closes the file after an error, so the next call opens it afresh.
// s.mu is held for writing.
func (s *BoltStore) fail() {
	if s.db != nil {
		_ = s.db.Close()
		s.db = nil
	}
}

// guard runs fn with the file open, turning a panic (a corrupt page) into
// an error. s.mu is held for writing.
func (s *BoltStore) guard(fn func() error) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("ledger file %s is corrupt: %v", s.path, p)
		}
		if err != nil {
			s.fail()
		}
	}()
	if err := s.open(); err != nil {
		return err
	}
	return fn()
}

// Claim implements Store.
func (s *BoltStore) Claim(agent, owner string) (cur string, err error) {
	if agent == "" || owner == "" {
		return "", errors.New("ledger: claim without an agent or an owner")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	err = s.guard(func() error {
		// A rejoin finds its claim without a write (and a sync).
		if err := s.db.View(func(tx *bolt.Tx) error {
			if v := tx.Bucket(bucketOwners).Get([]byte(agent)); v != nil {
				cur = string(v)
			}
			return nil
		}); err != nil || cur != "" {
			return err
		}
		if s.owners >= s.maxNames {
			// As many claims as the dictionary holds names: names that
			// strangers join under do not grow the file without bound.
			// An unclaimed name is nobody's: its history is shown to no
			// one (see ClaimAgent).
			return nil
		}
		return s.db.Update(func(tx *bolt.Tx) error {
			b := tx.Bucket(bucketOwners)
			if v := b.Get([]byte(agent)); v != nil {
				cur = string(v)
				return nil
			}
			cur = owner
			if err := b.Put([]byte(agent), []byte(owner)); err != nil {
				return err
			}
			s.owners++
			return nil
		})
	})
	return cur, err
}

// Seq implements Store.
func (s *BoltStore) Seq() (seq uint64, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	err = s.guard(func() error {
		return s.db.View(func(tx *bolt.Tx) error {
			seq = readSeq(tx)
			return nil
		})
	})
	return seq, err
}

func readSeq(tx *bolt.Tx) uint64 {
	v := tx.Bucket(bucketMeta).Get(keySeq)
	if len(v) != 8 {
		return 0
	}
	return binary.BigEndian.Uint64(v)
}

// Apply implements Store.
func (s *BoltStore) Apply(seq uint64, deltas []Delta) (applied bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	err = s.guard(func() error {
		added := map[string]uint32{} // names this transaction adds; kept only if it commits
		next := uint32(len(s.names))
		id := func(tx *bolt.Tx, name string) (uint32, error) {
			if v, ok := s.ids[name]; ok {
				return v, nil
			}
			if v, ok := added[name]; ok {
				return v, nil
			}
			if len(s.ids)+len(added) >= s.maxNames && name != Other {
				name = Other
				if v, ok := s.ids[name]; ok {
					return v, nil
				}
				if v, ok := added[name]; ok {
					return v, nil
				}
			}
			v := next
			next++
			var k [4]byte
			binary.BigEndian.PutUint32(k[:], v)
			if err := tx.Bucket(bucketIDs).Put(k[:], []byte(name)); err != nil {
				return 0, err
			}
			added[name] = v
			return v, nil
		}
		err := s.db.Update(func(tx *bolt.Tx) error {
			if readSeq(tx) >= seq {
				return nil
			}
			hourly, daily := tx.Bucket(bucketHourlyOpen), tx.Bucket(bucketDailyOpen)
			// bbolt keeps the key and value slices of a Put until the
			// commit: each Put gets its own.
			for i := range deltas {
				d := &deltas[i]
				if d.Hour < 0 || d.Hour > 1<<32-1 {
					continue // outside the layout's range: a clock far off, not a count
				}
				nid, err := id(tx, d.Name)
				if err != nil {
					return err
				}
				mid, err := id(tx, d.Model)
				if err != nil {
					return err
				}
				for _, r := range []struct {
					b      *bolt.Bucket
					period int64
				}{{hourly, d.Hour}, {daily, floorDiv(d.Hour, hoursPerDay)}} {
					if err := addRow(r.b, rowKey(make([]byte, 0, 16), r.period, d.Kind, nid, mid), d.Counts); err != nil {
						return err
					}
				}
			}
			var sb [8]byte
			binary.BigEndian.PutUint64(sb[:], seq)
			applied = true
			return tx.Bucket(bucketMeta).Put(keySeq, sb[:])
		})
		if err != nil {
			applied = false
			return fmt.Errorf("ledger file %s: %w", s.path, err)
		}
		for name, v := range added {
			for int(v) >= len(s.names) {
				s.names = append(s.names, "")
			}
			s.names[v] = name
			s.ids[name] = v
		}
		return nil
	})
	return applied, err
}

// addRow adds c to row k of b. bbolt keeps the key and value slices of a
// Put until the commit: k must be the caller's own.
func addRow(b *bolt.Bucket, k []byte, c Counts) error {
	if old := b.Get(k); old != nil {
		prev, err := decodeCounts(old)
		if err != nil {
			return fmt.Errorf("row %x: %w", k, err)
		}
		c.Add(prev)
	}
	return b.Put(k, encodeCounts(make([]byte, 0, 32), c))
}

// Seal implements Store.
func (s *BoltStore) Seal(hour int64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	err := s.guard(func() error {
		return s.db.Update(func(tx *bolt.Tx) error {
			for _, p := range []struct {
				open, sealed []byte
				before       int64
			}{{bucketHourlyOpen, bucketHourly, hour}, {bucketDailyOpen, bucketDaily, floorDiv(hour, hoursPerDay)}} {
				open, sealed := tx.Bucket(p.open), tx.Bucket(p.sealed)
				sealed.FillPercent = sealedFill
				var end [4]byte
				binary.BigEndian.PutUint32(end[:], uint32(min(max(p.before, 0), 1<<32-1)))
				var keys [][]byte
				c := open.Cursor()
				for k, v := c.First(); k != nil && bytes.Compare(k[:min(4, len(k))], end[:]) < 0; k, v = c.Next() {
					cv, err := decodeCounts(v)
					if err != nil {
						return fmt.Errorf("row %x: %w", k, err)
					}
					k = bytes.Clone(k)
					if err := addRow(sealed, k, cv); err != nil {
						return err
					}
					keys = append(keys, k)
				}
				for _, k := range keys {
					if err := open.Delete(k); err != nil {
						return err
					}
				}
			}
			return nil
		})
	})
	if err != nil {
		return fmt.Errorf("ledger file %s: seal: %w", s.path, err)
	}
	return nil
}

// Scan implements Store.
func (s *BoltStore) Scan(res Resolution, from, to int64, fn func(Row)) error {
	s.mu.Lock()
	if err := s.guard(func() error { return nil }); err != nil {
		s.mu.Unlock()
		return err
	}
	s.mu.Unlock()
	// Read under the read lock: Apply changes the dictionary only after
	// its commit, so every id a view sees has its name.
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.db == nil {
		return fmt.Errorf("ledger file %s: closed", s.path)
	}
	buckets := [][]byte{bucketHourly, bucketHourlyOpen}
	if res == Daily {
		buckets = [][]byte{bucketDaily, bucketDailyOpen}
	}
	from, to = max(from, 0), min(to, 1<<32)
	if from >= to {
		return nil
	}
	var err error
	func() {
		defer func() {
			if p := recover(); p != nil {
				err = fmt.Errorf("ledger file %s is corrupt: %v", s.path, p)
			}
		}()
		err = s.db.View(func(tx *bolt.Tx) error {
			for _, b := range buckets {
				c := tx.Bucket(b).Cursor()
				var start [4]byte
				binary.BigEndian.PutUint32(start[:], uint32(from))
				for k, v := c.Seek(start[:]); k != nil; k, v = c.Next() {
					r, err := s.decodeRow(k, v)
					if err != nil {
						return err
					}
					if r.Period >= to {
						break
					}
					r.Res = res
					fn(r)
				}
			}
			return nil
		})
	}()
	if err != nil {
		return fmt.Errorf("ledger file %s: %w", s.path, err)
	}
	return nil
}

// Prune implements Store: in transactions of at most pruneBatch rows, so
// a flush never waits long behind it.
func (s *BoltStore) Prune(hour, day int64) error {
	for _, p := range []struct {
		bucket []byte
		before int64
	}{{bucketHourly, hour}, {bucketHourlyOpen, hour}, {bucketDaily, day}, {bucketDailyOpen, day}} {
		if p.before <= 0 {
			continue
		}
		var end [4]byte
		binary.BigEndian.PutUint32(end[:], uint32(min(p.before, 1<<32-1)))
		for {
			n := 0
			s.mu.Lock()
			err := s.guard(func() error {
				return s.db.Update(func(tx *bolt.Tx) error {
					b := tx.Bucket(p.bucket)
					var keys [][]byte
					c := b.Cursor()
					for k, _ := c.First(); k != nil && string(k[:4]) < string(end[:]) && len(keys) < pruneBatch; k, _ = c.Next() {
						keys = append(keys, append([]byte(nil), k...))
					}
					for _, k := range keys {
						if err := b.Delete(k); err != nil {
							return err
						}
					}
					n = len(keys)
					return nil
				})
			})
			s.mu.Unlock()
			if err != nil {
				return fmt.Errorf("ledger file %s: prune: %w", s.path, err)
			}
			if n < pruneBatch {
				break
			}
		}
	}
	return nil
}

const pruneBatch = 10_000

// Close implements Store.
func (s *BoltStore) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.db == nil {
		return nil
	}
	err := s.db.Close()
	s.db = nil
	return err
}

func rowKey(dst []byte, period int64, k Kind, name, model uint32) []byte {
	dst = binary.BigEndian.AppendUint32(dst, uint32(period))
	dst = append(dst, byte(k))
	dst = binary.AppendUvarint(dst, uint64(name))
	return binary.AppendUvarint(dst, uint64(model))
}

var errBadRow = errors.New("malformed row")

func uvarintLen(v uint64) int {
	var b [binary.MaxVarintLen64]byte
	return binary.PutUvarint(b[:], v)
}

func (s *BoltStore) decodeRow(k, v []byte) (Row, error) {
	if len(k) < 7 {
		return Row{}, errBadRow
	}
	r := Row{Period: int64(binary.BigEndian.Uint32(k)), Kind: Kind(k[4])}
	if r.Kind < KindClient || r.Kind > KindProvider {
		return r, errBadRow
	}
	nid, n := binary.Uvarint(k[5:])
	if n <= 0 {
		return r, errBadRow
	}
	mid, m := binary.Uvarint(k[5+n:])
	if m <= 0 || 5+n+m != len(k) || nid >= uint64(len(s.names)) || mid >= uint64(len(s.names)) ||
		uvarintLen(nid) != n || uvarintLen(mid) != m { // one encoding per key, or rows could hide as twins
		return r, errBadRow
	}
	r.Name, r.Model = s.names[nid], s.names[mid]
	c, err := decodeCounts(v)
	r.Counts = c
	return r, err
}

func encodeCounts(dst []byte, c Counts) []byte {
	for _, v := range [...]int64{c.Requests, c.PromptTokens, c.CachedTokens, c.CompletionTokens, c.Errors, c.Estimated,
		int64(c.Serving / time.Microsecond), int64(c.Cost), int64(c.Saved)} {
		dst = binary.AppendUvarint(dst, uint64(max(v, 0)))
	}
	return dst
}

// Bounds of a decoded count: past them it is damage, not use (and would
// overflow a sum or a duration).
const (
	maxCount         = 1 << 60
	maxServingMicros = 1 << 50 // 35 years
)

func decodeCounts(b []byte) (Counts, error) {
	var f [9]int64
	for i := range f {
		v, n := binary.Uvarint(b)
		if n <= 0 || v > maxCount || (i == 6 && v > maxServingMicros) {
			return Counts{}, errBadRow
		}
		f[i], b = int64(v), b[n:]
	}
	if len(b) != 0 {
		return Counts{}, errBadRow
	}
	return Counts{Requests: f[0], PromptTokens: f[1], CachedTokens: f[2], CompletionTokens: f[3], Errors: f[4],
		Estimated: f[5], Serving: time.Duration(f[6]) * time.Microsecond, Cost: Money(f[7]), Saved: Money(f[8])}, nil
}
