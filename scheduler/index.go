package scheduler

import (
	"slices"
	"unsafe"

	"github.com/cespare/xxhash/v2"
)

// The merged prefix index: which endpoints hold which blocks, as their agents
// publish it (IndexReset, IndexApply), plus the prefixes the scheduler
// routed recently (recorded at once by Pick, before the agent's update
// comes). Guarded by Scheduler.mu.
//
// Each block maps to the set of endpoints holding it. Sets are interned:
// blocks held by the same endpoints share one sorted list of endpoint slots,
// so a prefix that every endpoint holds costs one list, not one per block,
// and walking a chain compares set numbers, not lists. Each endpoint also
// keeps the set of its blocks, so that it can be dropped whole.
type prefixIndex struct {
	blocks map[uint64]uint32 // block -> set id
	sets   []holderSet
	intern map[uint64]uint32 // hash of a set's members -> set id
	free   []uint32          // free set ids
	single []uint32          // slot -> the id of the set holding only that slot (0: none yet)

	byID     map[string]*epIndex
	slots    []*epIndex // by slot; nil when free
	slotFree []uint16

	scratch []uint16
	trans   map[uint64]setRef // (set, slot, add) -> resulting set
	setGen  uint64

	routes   [routeSlots]route
	routePos int
}

type holderSet struct {
	members []uint16 // endpoint slots, sorted
	refs    int32    // blocks mapped to this set
	key     uint64   // hash of members
	gen     uint64   // tells a reused id from the set it held before
}

// setRef is a cached transition's result, valid while both sets are
// the ones it was made with: ids are reused once a set is freed.
type setRef struct {
	id      uint32
	gen     uint64 // the resulting set's gen
	fromGen uint64 // the gen of the set it started from
}

// maxTransitions bounds the transition cache.
const maxTransitions = 1 << 12

// epIndex is one endpoint's published entries.
type epIndex struct {
	id     string
	slot   uint16
	blocks map[uint64]struct{}
	// Overlap scratch of the current pick: valid when gen matches.
	gen     uint64
	overlap int
}

// overlapOf returns the overlap the pick stamped gen found (see
// prefixIndex.overlaps); 0 when x is nil or was not stamped.
func (x *epIndex) overlapOf(gen uint64) int {
	if x == nil || x.gen != gen {
		return 0
	}
	return x.overlap
}

// route is a prefix Pick sent to an endpoint, kept until its agent's
// update has had time to arrive.
type route struct {
	ix    *epIndex
	at    int64 // when routed, nanoseconds since the scheduler's epoch
	n     int
	chain [routeBlocks]uint64
}

const (
	// routeSlots is how many recently routed prefixes are remembered.
	routeSlots = 64
	// routeBlocks is how many leading blocks of a routed prefix are kept.
	routeBlocks = 512
	// routeTTL is how long a routed prefix counts as held without the
	// agent's confirmation: long enough for its update to arrive.
	routeTTL = int64(30e9)
	// MaxEndpointBlocks bounds one endpoint's entries in the index;
	// additions beyond it are ignored.
	MaxEndpointBlocks = 1 << 18
	// maxSlots bounds the endpoints that may publish.
	maxSlots = 1 << 16
)

// IndexStats describes the merged prefix index.
type IndexStats struct {
	// Endpoints is the number of endpoints with entries.
	Endpoints int
	// Entries counts (block, endpoint) pairs; Blocks distinct blocks; Sets
	// distinct holder sets.
	Entries, Blocks, Sets int
	// Routes counts recently routed prefixes not yet expired.
	Routes int
	// Bytes estimates the index's memory.
	Bytes int64
}

func newPrefixIndex() *prefixIndex {
	return &prefixIndex{
		blocks: make(map[uint64]uint32),
		intern: make(map[uint64]uint32),
		sets:   []holderSet{{}}, // id 0 is never used
		byID:   make(map[string]*epIndex),
		trans:  make(map[uint64]setRef),
	}
}

// endpointIndex returns id's entry, creating it when create is set.
func (p *prefixIndex) endpointIndex(id string, create bool) *epIndex {
	if x := p.byID[id]; x != nil || !create {
		return x
	}
	var slot uint16
	if n := len(p.slotFree); n > 0 {
		slot = p.slotFree[n-1]
		p.slotFree = p.slotFree[:n-1]
	} else {
		if len(p.slots) >= maxSlots {
			return nil
		}
		slot = uint16(len(p.slots))
		p.slots = append(p.slots, nil)
		p.single = append(p.single, 0)
	}
	x := &epIndex{id: id, slot: slot, blocks: make(map[uint64]struct{})}
	p.slots[slot] = x
	p.byID[id] = x
	return x
}

func membersKey(m []uint16) uint64 {
	if len(m) == 0 {
		return 0
	}
	// The key is local to this process: byte order does not matter.
	return xxhash.Sum64(unsafe.Slice((*byte)(unsafe.Pointer(&m[0])), 2*len(m)))
}

// transition returns the set that adding (or removing) slot to (from) set
// id gives, from the cache of recent transitions: a prefix that endpoints
// publish one after another makes the same transition for every block.
func (p *prefixIndex) transition(id uint32, slot uint16, add bool) (uint32, bool) {
	k := uint64(id)<<17 | uint64(slot)<<1
	if add {
		k |= 1
	}
	t, ok := p.trans[k]
	if !ok || p.sets[id].gen != t.fromGen || p.sets[t.id].refs <= 0 || p.sets[t.id].gen != t.gen {
		return 0, false
	}
	p.sets[t.id].refs++
	return t.id, true
}

func (p *prefixIndex) remember(id uint32, slot uint16, add bool, to uint32) {
	if len(p.trans) >= maxTransitions {
		clear(p.trans)
	}
	k := uint64(id)<<17 | uint64(slot)<<1
	if add {
		k |= 1
	}
	p.trans[k] = setRef{id: to, gen: p.sets[to].gen, fromGen: p.sets[id].gen}
}

// internSet returns the id of the set with members m (copied if new), with
// one more reference.
func (p *prefixIndex) internSet(m []uint16) uint32 {
	if len(m) == 1 {
		if id := p.single[m[0]]; id != 0 {
			p.sets[id].refs++
			return id
		}
	}
	key := membersKey(m)
	if id, ok := p.intern[key]; ok && slices.Equal(p.sets[id].members, m) {
		p.sets[id].refs++
		return id
	}
	var id uint32
	if n := len(p.free); n > 0 {
		id = p.free[n-1]
		p.free = p.free[:n-1]
	} else {
		p.sets = append(p.sets, holderSet{})
		id = uint32(len(p.sets) - 1)
	}
	p.setGen++
	p.sets[id] = holderSet{members: slices.Clone(m), refs: 1, key: key, gen: p.setGen}
	if _, taken := p.intern[key]; !taken {
		p.intern[key] = id
	}
	if len(m) == 1 {
		p.single[m[0]] = id
	}
	return id
}

func (p *prefixIndex) release(id uint32) {
	st := &p.sets[id]
	st.refs--
	if st.refs > 0 {
		return
	}
	if p.intern[st.key] == id {
		delete(p.intern, st.key)
	}
	if len(st.members) == 1 && p.single[st.members[0]] == id {
		p.single[st.members[0]] = 0
	}
	*st = holderSet{}
	p.free = append(p.free, id)
}

// add records that x holds h.
func (p *prefixIndex) add(x *epIndex, h uint64) {
	if _, ok := x.blocks[h]; ok || len(x.blocks) >= MaxEndpointBlocks {
		return
	}
	x.blocks[h] = struct{}{}
	old, ok := p.blocks[h]
	if !ok {
		p.scratch = append(p.scratch[:0], x.slot)
		p.blocks[h] = p.internSet(p.scratch)
		return
	}
	nid, ok := p.transition(old, x.slot, true)
	if !ok {
		m := p.sets[old].members
		i, _ := slices.BinarySearch(m, x.slot)
		p.scratch = append(append(append(p.scratch[:0], m[:i]...), x.slot), m[i:]...)
		nid = p.internSet(p.scratch)
		p.remember(old, x.slot, true, nid)
	}
	p.blocks[h] = nid
	p.release(old)
}

// remove records that x no longer holds h.
func (p *prefixIndex) remove(x *epIndex, h uint64) {
	if _, ok := x.blocks[h]; !ok {
		return
	}
	delete(x.blocks, h)
	old, ok := p.blocks[h]
	if !ok {
		return
	}
	m := p.sets[old].members
	i, found := slices.BinarySearch(m, x.slot)
	if !found {
		return
	}
	if len(m) == 1 {
		delete(p.blocks, h)
	} else if nid, ok := p.transition(old, x.slot, false); ok {
		p.blocks[h] = nid
	} else {
		p.scratch = append(append(p.scratch[:0], m[:i]...), m[i+1:]...)
		nid = p.internSet(p.scratch)
		p.remember(old, x.slot, false, nid)
		p.blocks[h] = nid
	}
	p.release(old)
}

// drop forgets every entry of x and frees its slot.
func (p *prefixIndex) drop(x *epIndex) {
	for h := range x.blocks {
		p.remove(x, h)
	}
	for i := range p.routes {
		if p.routes[i].ix == x {
			p.routes[i].ix, p.routes[i].n = nil, 0
		}
	}
	delete(p.byID, x.id)
	p.slots[x.slot] = nil
	p.slotFree = append(p.slotFree, x.slot)
}

// recordRoute remembers that chain was just routed to x.
func (p *prefixIndex) recordRoute(x *epIndex, chain []uint64, now int64) {
	if len(chain) == 0 {
		return
	}
	n := min(len(chain), routeBlocks)
	// The same prefix routed to the same endpoint again refreshes its slot.
	for i := range p.routes {
		r := &p.routes[i]
		if r.ix == x && r.n >= n && r.chain[n-1] == chain[n-1] {
			r.at = now
			return
		}
	}
	r := &p.routes[p.routePos]
	p.routePos = (p.routePos + 1) % routeSlots
	r.ix, r.at, r.n = x, now, n
	copy(r.chain[:n], chain)
}

// overlaps sets, for every endpoint with entries, the number of leading
// blocks of chain it is believed to hold, stamping them with gen. It
// relies on holding being prefix-closed (an engine that holds a block
// holds the blocks before it, as engines evict a chain tail first): equal
// holder sets at two depths mean equal sets between them, so the walk
// gallops over runs of one set instead of looking up every block. It
// returns the largest overlap.
func (p *prefixIndex) overlaps(chain []uint64, gen uint64, now int64) int {
	best := 0
	set := func(x *epIndex, n int) {
		if x.gen != gen {
			x.gen, x.overlap = gen, 0
		}
		if n > x.overlap {
			x.overlap = n
		}
		best = max(best, n)
	}
	for i := range p.routes {
		r := &p.routes[i]
		if r.ix == nil || r.n == 0 || now-r.at > routeTTL || r.chain[0] != chain[0] {
			continue
		}
		n := 1
		for m := min(r.n, len(chain)); n < m && r.chain[n] == chain[n]; n++ {
		}
		set(r.ix, n)
	}
	L := len(chain)
	lookup := func(i int) uint32 { return p.blocks[chain[i]] }
	cur := lookup(0)
	if cur == 0 {
		return best
	}
	// ext: the slots holding every block so far.
	ext := append(p.scratch[:0], p.sets[cur].members...)
	i := 0
	for {
		// Find the last index lo >= i whose set is cur.
		lo, hi := i, L
		for step := 1; ; step *= 2 {
			j := lo + step
			if j >= L {
				j = L - 1
				if j <= lo {
					break
				}
			}
			if lookup(j) == cur {
				lo = j
				if j == L-1 {
					break
				}
			} else {
				hi = j
				break
			}
		}
		for hi-lo > 1 && hi < L {
			mid := int(uint(lo+hi) / 2)
			if lookup(mid) == cur {
				lo = mid
			} else {
				hi = mid
			}
		}
		next := lo + 1
		if next >= L {
			for _, s := range ext {
				set(p.slots[s], L)
			}
			break
		}
		nid := lookup(next)
		var nm []uint16
		if nid != 0 {
			nm = p.sets[nid].members
		}
		// ext ∩ nm (both sorted: one merge); the rest stop at next.
		k, j := 0, 0
		for _, s := range ext {
			for j < len(nm) && nm[j] < s {
				j++
			}
			if j < len(nm) && nm[j] == s {
				ext[k] = s
				k++
				j++
			} else {
				set(p.slots[s], next)
			}
		}
		ext = ext[:k]
		if k == 0 {
			break
		}
		cur, i = nid, next
	}
	p.scratch = ext[:0]
	return best
}

func (p *prefixIndex) stats(now int64) IndexStats {
	st := IndexStats{Endpoints: len(p.byID), Blocks: len(p.blocks)}
	var members int
	for _, x := range p.byID {
		st.Entries += len(x.blocks)
	}
	for i := 1; i < len(p.sets); i++ {
		if p.sets[i].refs > 0 {
			st.Sets++
			members += len(p.sets[i].members)
		}
	}
	for i := range p.routes {
		if p.routes[i].ix != nil && now-p.routes[i].at <= routeTTL {
			st.Routes++
		}
	}
	// Swiss-table maps: a slot of key and value plus a control byte, at
	// the load of 7/8 they grow at (about 3/4 on average), and the
	// interned sets' headers and members.
	// Calibrated on a measured index (TestIndexMemory).
	mapBytes := func(n int, slot int) int64 { return int64(float64(n*(slot+1)) / 0.55) }
	st.Bytes = mapBytes(st.Blocks, 16) + mapBytes(st.Entries, 8) + mapBytes(st.Sets, 16) +
		int64(len(p.sets))*40 + int64(members)*2 + int64(routeSlots)*(routeBlocks*8+32)
	return st
}

// IndexReset replaces endpoint id's entries in the prefix index with
// snapshot, as its agent publishes on joining and after any gap. An id not
// (yet) registered with Upsert may publish; Remove and IndexDrop forget it.
func (s *Scheduler) IndexReset(id string, snapshot []uint64) {
	if id == "" {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if x := s.index.byID[id]; x != nil {
		s.index.drop(x)
	}
	x := s.index.endpointIndex(id, true)
	if x == nil {
		return
	}
	for _, h := range snapshot {
		s.index.add(x, h)
	}
	if e := s.endpoints[id]; e != nil {
		e.ix = x
	}
}

// IndexApply applies one delta from endpoint id's agent: the hashes in
// added are now held, then those in evicted are not. A publisher that
// coalesces several changes must leave out of evicted a hash it added again
// after evicting it.
func (s *Scheduler) IndexApply(id string, added, evicted []uint64) {
	if id == "" {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	x := s.index.endpointIndex(id, len(added) > 0)
	if x == nil {
		return
	}
	for _, h := range added {
		s.index.add(x, h)
	}
	for _, h := range evicted {
		s.index.remove(x, h)
	}
	if e := s.endpoints[id]; e != nil {
		e.ix = x
	}
}

// IndexDrop forgets endpoint id's entries (Remove does this too).
func (s *Scheduler) IndexDrop(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.indexDrop(id)
}

func (s *Scheduler) indexDrop(id string) {
	x := s.index.byID[id]
	if x == nil {
		return
	}
	s.index.drop(x)
	if e := s.endpoints[id]; e != nil && e.ix == x {
		e.ix = nil
	}
}

// IndexStats returns the size of the merged prefix index.
func (s *Scheduler) IndexStats() IndexStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.index.stats(s.now())
}
