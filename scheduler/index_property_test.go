package scheduler

import (
	"fmt"
	"maps"
	"slices"
	"testing"
)

// indexMachine drives a scheduler's merged prefix index through its API
// (IndexReset, IndexApply, IndexDrop, Upsert, Remove) and a model: the set
// of blocks each endpoint published, and which endpoints are registered.
// In closed mode every endpoint's blocks stay prefix-closed (an engine
// holding a block holds its parent), as agents publish them, and the
// overlaps a pick computes are checked too; in free mode publications
// are arbitrary and only the structure is checked.
type indexMachine struct {
	t      *testing.T
	s      *Scheduler
	closed bool

	blocks     map[string]map[uint64]bool // endpoint -> published blocks
	registered map[string]bool
}

var indexIDs = []string{"e0", "e1", "e2", "e3", "e4"}

// The tree of prompt blocks the closed mode publishes: three families,
// each a trunk of indexDepth blocks and two branches leaving it at depths
// 3 and 6.
const (
	indexFamilies = 3
	indexBranches = 3
	indexDepth    = 16
)

func indexSplit(b uint64) int { return int(3 * b) }

// indexNode returns the block at depth d of branch b of family f.
func indexNode(f, b uint64, d int) uint64 {
	if d < indexSplit(b) {
		b = 0
	}
	return 1<<62 | f<<32 | b<<16 | uint64(d)
}

// indexParent returns the parent of a tree block, false for a root.
func indexParent(h uint64) (uint64, bool) {
	f, b, d := h>>32&0xff, h>>16&0xffff, int(h&0xffff)
	if d == 0 {
		return 0, false
	}
	return indexNode(f, b, d-1), true
}

func indexPath(f, b uint64, n int) []uint64 {
	c := make([]uint64, n)
	for d := range c {
		c[d] = indexNode(f, b, d)
	}
	return c
}

// randomNode returns a block of the tree, or rarely one outside it.
func randomNode(o *opBytes) uint64 {
	if o.intn(16) == 0 {
		return 1<<61 | uint64(o.intn(8))
	}
	f, b := uint64(o.intn(indexFamilies)), uint64(o.intn(indexBranches))
	return indexNode(f, b, o.intn(indexDepth))
}

func newIndexMachine(t *testing.T, o *opBytes) *indexMachine {
	s, _ := newTest(t, Config{})
	return &indexMachine{t: t, s: s, closed: o.intn(2) == 0,
		blocks: map[string]map[uint64]bool{}, registered: map[string]bool{}}
}

func (m *indexMachine) add(id string, h uint64) {
	set := m.blocks[id]
	if !set[h] && len(set) < MaxEndpointBlocks {
		set[h] = true
	}
}

func (m *indexMachine) step(o *opBytes) {
	id := indexIDs[o.intn(len(indexIDs))]
	switch op := o.intn(16); {
	case op < 4 && m.closed: // a path grows: its missing blocks are added
		n := 1 + o.intn(indexDepth)
		path := indexPath(uint64(o.intn(indexFamilies)), uint64(o.intn(indexBranches)), n)
		added := slices.DeleteFunc(path, func(h uint64) bool { return m.blocks[id][h] })
		m.apply(id, added, nil)
	case op < 4: // anything added and evicted, in one delta
		var added, evicted []uint64
		for range o.intn(12) {
			added = append(added, randomNode(o))
		}
		for range o.intn(12) {
			evicted = append(evicted, randomNode(o))
		}
		m.apply(id, added, evicted)
	case op < 7: // a held block goes, with everything below it
		held := slices.Sorted(maps.Keys(m.blocks[id]))
		if len(held) == 0 {
			m.apply(id, nil, []uint64{randomNode(o)})
			return
		}
		gone := held[o.intn(len(held))]
		evicted := []uint64{gone}
		for _, h := range held {
			for p, ok := indexParent(h); ok; p, ok = indexParent(p) {
				if p == gone {
					evicted = append(evicted, h)
					break
				}
			}
		}
		m.apply(id, nil, evicted)
	case op < 9: // a snapshot: a few paths, or anything in free mode
		var snap []uint64
		for range o.intn(5) {
			if m.closed {
				snap = append(snap, indexPath(uint64(o.intn(indexFamilies)), uint64(o.intn(indexBranches)), o.intn(indexDepth))...)
			} else {
				snap = append(snap, randomNode(o))
			}
		}
		m.s.IndexReset(id, snap)
		m.blocks[id] = map[uint64]bool{}
		for _, h := range snap {
			m.add(id, h)
		}
	case op < 10:
		m.s.IndexDrop(id)
		delete(m.blocks, id)
	case op < 11:
		// Remove forgets a registered endpoint's entries; an endpoint
		// never registered keeps what it published.
		m.s.Remove(id)
		if m.registered[id] {
			delete(m.blocks, id)
			delete(m.registered, id)
		}
	case op < 12:
		m.s.Upsert(ep(id))
		m.registered[id] = true
	default:
		m.checkOverlaps()
	}
	m.check()
}

// floodEndpoint publishes more blocks than one endpoint may hold for id,
// checks that the excess was ignored, and takes them back.
func (m *indexMachine) floodEndpoint(id string) {
	added := make([]uint64, MaxEndpointBlocks+3)
	for i := range added {
		added[i] = 1<<60 | uint64(i)
	}
	had := len(m.blocks[id])
	m.s.IndexApply(id, added, nil)
	st := m.s.IndexStats()
	m.s.mu.Lock()
	n := len(m.s.index.byID[id].blocks)
	m.s.mu.Unlock()
	entries := 0
	for _, set := range m.blocks {
		entries += len(set)
	}
	if n != MaxEndpointBlocks || st.Entries != entries-had+MaxEndpointBlocks {
		m.t.Fatalf("%s holds %d blocks after a flood, bound %d; %d entries in all, model %d", id, n, MaxEndpointBlocks, st.Entries, entries-had+MaxEndpointBlocks)
	}
	m.s.IndexApply(id, nil, added)
	if m.blocks[id] == nil {
		m.blocks[id] = map[uint64]bool{} // created by the flood, empty again
	}
}

// apply publishes one delta and applies it to the model as IndexApply
// defines it: added first, then evicted.
func (m *indexMachine) apply(id string, added, evicted []uint64) {
	m.s.IndexApply(id, added, evicted)
	if m.blocks[id] == nil {
		if len(added) == 0 {
			return
		}
		m.blocks[id] = map[uint64]bool{}
	}
	for _, h := range added {
		m.add(id, h)
	}
	for _, h := range evicted {
		delete(m.blocks[id], h)
	}
}

// holders returns the endpoints whose published blocks include h.
func (m *indexMachine) holders(h uint64) []string {
	var out []string
	for id, set := range m.blocks {
		if set[h] {
			out = append(out, id)
		}
	}
	slices.Sort(out)
	return out
}

// check compares the index's structure with the model: every endpoint's
// entries, every block's holder set, each holder set interned once and
// counted by the blocks that use it, freed sets and slots reusable, and
// IndexStats.
func (m *indexMachine) check() {
	t, s := m.t, m.s
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.index
	if len(p.byID) != len(m.blocks) {
		t.Fatalf("%d endpoints indexed, model %d", len(p.byID), len(m.blocks))
	}
	slotOf := map[uint16]string{}
	for id, set := range m.blocks {
		x := p.byID[id]
		if x == nil {
			t.Fatalf("%s not indexed", id)
		}
		if int(x.slot) >= len(p.slots) || p.slots[x.slot] != x {
			t.Fatalf("%s: slot %d does not hold it", id, x.slot)
		}
		slotOf[x.slot] = id
		if len(x.blocks) != len(set) {
			t.Fatalf("%s holds %d blocks, model %d", id, len(x.blocks), len(set))
		}
		for h := range set {
			if _, ok := x.blocks[h]; !ok {
				t.Fatalf("%s lacks %x", id, h)
			}
		}
		if e := s.endpoints[id]; e != nil && e.ix != x {
			t.Fatalf("registered %s does not point at its entries", id)
		}
	}
	for id := range m.registered {
		if e := s.endpoints[id]; e == nil || (m.blocks[id] == nil && e.ix != nil) {
			t.Fatalf("registered %s: %+v", id, e)
		}
	}
	// Slots: each in use or free, once.
	free := map[uint16]bool{}
	for _, sl := range p.slotFree {
		if free[sl] || p.slots[sl] != nil {
			t.Fatalf("slot %d free twice, or free and in use", sl)
		}
		free[sl] = true
	}
	if len(free)+len(p.byID) != len(p.slots) {
		t.Fatalf("%d slots: %d free, %d in use", len(p.slots), len(free), len(p.byID))
	}
	// Blocks and their holder sets.
	union := map[uint64]bool{}
	for _, set := range m.blocks {
		for h := range set {
			union[h] = true
		}
	}
	if len(p.blocks) != len(union) {
		t.Fatalf("%d blocks indexed, model %d", len(p.blocks), len(union))
	}
	refs := map[uint32]int32{}
	for h, sid := range p.blocks {
		if !union[h] {
			t.Fatalf("block %x indexed, held by nobody", h)
		}
		if sid == 0 || int(sid) >= len(p.sets) {
			t.Fatalf("block %x maps to set %d of %d", h, sid, len(p.sets))
		}
		var got []string
		for _, sl := range p.sets[sid].members {
			got = append(got, slotOf[sl])
		}
		slices.Sort(got)
		if want := m.holders(h); !slices.Equal(got, want) {
			t.Fatalf("block %x held by %v, model %v", h, got, want)
		}
		refs[sid]++
	}
	// Sets: counted right, interned once, freed when unused.
	freeSets := map[uint32]bool{}
	for _, id := range p.free {
		if freeSets[id] {
			t.Fatalf("set %d free twice", id)
		}
		freeSets[id] = true
	}
	byMembers := map[string]uint32{}
	live := 0
	for id := uint32(1); int(id) < len(p.sets); id++ {
		st := &p.sets[id]
		if st.refs != refs[id] {
			t.Fatalf("set %d %v: %d refs, %d blocks use it", id, st.members, st.refs, refs[id])
		}
		if st.refs == 0 {
			if !freeSets[id] || len(st.members) != 0 {
				t.Fatalf("unused set %d (%v) not freed", id, st.members)
			}
			continue
		}
		live++
		if freeSets[id] {
			t.Fatalf("set %d in use and free", id)
		}
		if len(st.members) == 0 || !slices.IsSorted(st.members) || len(slices.Compact(slices.Clone(st.members))) != len(st.members) {
			t.Fatalf("set %d members %v", id, st.members)
		}
		k := fmt.Sprint(st.members)
		if o, dup := byMembers[k]; dup {
			t.Fatalf("holder set %v interned twice: %d and %d", st.members, o, id)
		}
		byMembers[k] = id
		if st.key != membersKey(st.members) || p.intern[st.key] != id {
			t.Fatalf("set %d %v not found by its key", id, st.members)
		}
		if len(st.members) == 1 && p.single[st.members[0]] != id {
			t.Fatalf("single-holder set %d of slot %d not found by the slot", id, st.members[0])
		}
	}
	if len(freeSets)+live != len(p.sets)-1 {
		t.Fatalf("%d sets: %d free, %d in use", len(p.sets)-1, len(freeSets), live)
	}
	for key, id := range p.intern {
		if st := &p.sets[id]; st.refs <= 0 || st.key != key {
			t.Fatalf("intern entry %x points at set %d (refs %d, key %x)", key, id, st.refs, st.key)
		}
	}
	for sl, id := range p.single {
		if id != 0 && (p.sets[id].refs <= 0 || !slices.Equal(p.sets[id].members, []uint16{uint16(sl)})) {
			t.Fatalf("slot %d's single set %d is %v", sl, id, p.sets[id].members)
		}
	}
	st := p.stats(s.now())
	entries := 0
	for _, set := range m.blocks {
		entries += len(set)
	}
	if st.Endpoints != len(m.blocks) || st.Entries != entries || st.Blocks != len(union) || st.Sets != live {
		t.Fatalf("stats %+v; model %d endpoints, %d entries, %d blocks, %d sets", st, len(m.blocks), entries, len(union), live)
	}
}

// checkOverlaps compares, while every endpoint's blocks are prefix-closed,
// the overlaps a pick computes for every path of the tree with the model:
// the number of leading blocks each endpoint holds.
func (m *indexMachine) checkOverlaps() {
	for _, set := range m.blocks {
		for h := range set {
			if p, ok := indexParent(h); ok && h&(1<<62) != 0 && !set[p] {
				return // not prefix-closed: overlaps is not defined
			}
		}
	}
	t, s := m.t, m.s
	s.mu.Lock()
	defer s.mu.Unlock()
	for f := range uint64(indexFamilies) {
		for b := range uint64(indexBranches) {
			for _, chain := range [][]uint64{indexPath(f, b, indexDepth), append(indexPath(f, b, 5), 7)} {
				s.pickGen++
				best := s.index.overlaps(chain, s.pickGen, s.now())
				wantBest := 0
				for id, set := range m.blocks {
					n := 0
					for n < len(chain) && set[chain[n]] {
						n++
					}
					wantBest = max(wantBest, n)
					if got := s.index.byID[id].overlapOf(s.pickGen); got != n {
						t.Fatalf("%s overlaps %x by %d, model %d", id, chain, got, n)
					}
				}
				if best != wantBest {
					t.Fatalf("best overlap of %x %d, model %d", chain, best, wantBest)
				}
			}
		}
	}
}

// TestIndexProperties: random snapshots, deltas, drops and endpoint
// registrations, prefix-closed or not, keep the merged index equal to its
// model: each endpoint's entries, each block's holders, holder sets
// interned once and freed when unused, slots reused, the per-endpoint
// bound kept (TestIndexEndpointBound), IndexStats right, and (prefix-closed) each endpoint's
// overlap with every chain.
func TestIndexProperties(t *testing.T) { checkProperty(t, 120, 400, newIndexMachine) }

// TestIndexEndpointBound: an endpoint that publishes more blocks than
// MaxEndpointBlocks keeps that many, and the rest of the index is intact
// (apart from the property test: a flood is slow).
func TestIndexEndpointBound(t *testing.T) {
	o := &opBytes{b: []byte{0, 1, 0, 5, 1, 2, 3, 9, 7, 0, 1, 0, 5, 1, 0, 2, 6, 3, 0, 1, 2, 4}}
	m := newIndexMachine(t, o)
	for !o.done() {
		m.step(o)
	}
	m.floodEndpoint("e1")
	m.check()
}

// FuzzIndex is TestIndexProperties on the fuzzer's operation sequences.
func FuzzIndex(f *testing.F) {
	f.Add([]byte{0, 0, 0, 1, 0, 5, 1, 1, 0, 2, 9, 0, 13, 2, 8, 1, 1, 14, 3, 5, 0})
	f.Add([]byte{1, 0, 3, 5, 1, 2, 3, 4, 5, 6, 7, 1, 1, 0, 9, 2, 10, 3, 11, 0, 4, 5})
	fuzzMachine(f, 1024, newIndexMachine)
}
