// Package scheduler picks which agent serves each inference request.
//
// An inference engine keeps the KV cache of the prompts it has just
// processed. A follow-up turn sent to the engine that served the previous
// turn skips most of its prefill, which is worth an order of magnitude in
// time to first token. The scheduler therefore remembers, per session, the
// endpoint that last served it and sends the session back there while that
// endpoint can take it; everything else (new sessions, sessions whose
// endpoint is gone or saturated) is placed by a score. The package is pure:
// no I/O, no goroutines, time only from Config.Clock. A Scheduler is safe
// for concurrent use; one mutex guards all of its state, which keeps every
// decision consistent and costs tens of nanoseconds per call.
//
// # Use
//
// The relay registers endpoints with Upsert, Remove and SetHealth. For each
// request it calls Begin, then Pick; it sends the request to the chosen
// endpoint and hands the Choice back to Report with the Outcome. If the
// returned Class is Retryable it calls Pick again on the same Attempt,
// which by then excludes what failed. Every Choice must be reported exactly
// once: Report releases the in-flight slot that Pick reserved.
//
// # Endpoints and models
//
// Endpoints are indexed by model, so a pick only looks at the endpoints
// serving the requested model. Weight 0 (or invalid) means 1; Capacity 0
// means unlimited. Pick returns ErrUnknownModel only when no registered
// endpoint lists the model at all (HTTP 404); when endpoints list it but
// none may take the request (disabled, draining, breaker open, full) it
// returns an *UnavailableError (HTTP 503, or 429 when every candidate is
// rate limited). Models lists the models of endpoints that are neither
// disabled nor draining.
//
// # What "allowed right now" means
//
// An endpoint is allowed for an attempt when all of these hold, checked in
// this order: it is not disabled; it has not answered 401/403 earlier in this
// request (dead key); it has not answered 429 earlier in this request (used
// key); it serves the model; it is not draining; its breaker is closed, or
// half-open with a free probe slot; if it has a capacity, it has a free
// slot (see Capacity below); and, if it has a PrefillLimit, the uncached
// blocks of the streamed requests it was sent that have not started are
// below it, or no more than the blocks of this request's prefix it holds.
// An endpoint that lacks only a slot or that room is full: a request that
// finds every endpoint full waits in the Queue. Attempt.Excluded reports the first
// of the four per-request exclusions that applies.
//
// Among allowed endpoints, two kinds are avoided and used only when nothing
// else is allowed: endpoints gossip marks Suspect, and endpoints that failed
// (5xx, timeout, connection error) earlier in this request, so a retry goes
// elsewhere when it can but a lone endpoint can still be retried.
//
// Per-request exclusions live in the Attempt and nowhere else; the only
// memory shared across requests is the breaker, the statistics behind the
// score, and the session table.
//
// # Session affinity
//
// The session table maps a session key to the endpoint that last served it
// successfully, with the time of that success. An entry is live while its
// idle time is below Config.SessionTTL (5 minutes): 4m59s after the last
// success is a hit, 5m00s is not. A success (re)maps the session and
// refreshes the entry; an endpoint failure on the mapped endpoint evicts
// it; Remove drops the endpoint's sessions (lazily: they are forgotten the
// next time they are looked up or reach the end of the list). Dead keys,
// rate limits and client faults leave the mapping alone. The table is an LRU
// bounded by Config.MaxSessions (1,000,000), ordered by last success, so
// expired entries are purged from its tail as the table is used.
//
// With the sticky policy, a live mapping is used when its endpoint is
// allowed right now (with the larger affinity capacity below), is not
// avoided (suspect, or failed in this request), and its engine is not
// saturated (Health.Waiting > 0 and Health.KVCacheUsage >=
// Config.SaturatedKVUsage, 0.98). Where the mapped endpoint's agent
// publishes what its engine holds (see Prefixes) and the request has a
// Prefix, the mapping is weighed rather than obeyed: the mapped endpoint
// competes on the prefix cost with the others, at its affinity capacity,
// and wins every tie, so the session stays while its endpoint is as good a
// place as any and leaves when the figures say another starts the request
// sooner (the same prefix held elsewhere with less prefill ahead, or its
// own backlog hot); a session key never places a request worse than no
// key would. Where nothing is published, being busier than other
// endpoints is not a reason to leave: the scheduler cannot tell what a
// move would throw away, and queueing behind a few requests costs far less
// than a cold prefill elsewhere. The session then leaves only when its
// endpoint is unavailable (disabled, draining, breaker open, gone), truly
// saturated, or failed in this request. It is then placed by score, and
// the next success re-maps it.
//
// # Capacity
//
// Capacity bounds what the scheduler places on an endpoint: new sessions,
// moved sessions and requests without a session key stop at Capacity
// requests in flight. The endpoint a session is mapped to may take that
// session's requests up to Capacity × Config.AffinityCapacity (2, rounded
// up) in flight, under every policy: engines queue what they cannot batch,
// and a short wait where the cache is costs less than a cold prefill
// elsewhere, which would also spend several times the engine time and,
// under load, push the whole cluster towards more misses. Only beyond that
// is the endpoint truly saturated and the session moved. Set
// AffinityCapacity to 1 to make Capacity strict for everyone. When no candidate has room, Pick returns an
// *UnavailableError and the relay decides whether to wait or fail. The
// test TestStickyMultiTurnChat simulates multi-turn chat on engines with
// and without capacity pressure and checks that the sticky policy keeps at
// least 90% of an oracle's cache hits with requests per engine within 1.3
// of the mean.
//
// Choice.Affinity is AffinityHit when the chosen endpoint is the session's
// live mapped endpoint (by affinity or because the score chose it anyway),
// AffinityMiss when the request has a session key but went elsewhere or
// had no live mapping (a new or expired session), and AffinityNone when the
// request has no session key. The comparison policies report it the same
// way.
//
// # Prefixes
//
// Most clients name no session, so the scheduler also knows which prompt
// prefixes each endpoint's engine holds. PromptBlocks turns a request body
// into a chain of block hashes over its canonical prompt (tools, then each
// message's role and content; a block is 64 tokens approximated as 256
// bytes; xxhash64 of the text from its start to the block's end, so a hash
// names its whole prefix and every process agrees; at most 4,096 blocks,
// no allocation). Agents keep a BlockLRU of what their engine holds,
// corrected from the engine's cached_tokens, and publish its changes; the
// Scheduler merges them (IndexReset, IndexApply, IndexDrop, bounded per
// endpoint) into one index of block -> endpoints with interned holder sets.
//
// With the sticky policy, a request with a Prefix and no live session
// mapping (no key, a new or expired session, or a session whose endpoint
// cannot take it), or whose mapped endpoint publishes, is placed by
// prefix: each admitted endpoint's cost is its
// prefill backlog (uncached blocks of requests picked and not Started, and
// the engine's queue), its expected load at the mean request size, and the
// prompt's blocks after the prefix it holds, weighed up 101 times while the
// load is even and 4 times once the cache's choice is hot (expected load
// over 1.5 × the least loaded + 8), so a hot prefix spreads to a second
// endpoint instead of piling onto one; SGLang's balance rule (64 and 1.5)
// falls back to the least loaded. The cost is divided by weight and success
// rate (weight alone in cold start). Equal costs go by rendezvous hashing of
// the prefix's first blocks, so independent relays place a new prefix alike.
// Pick records the routed prefix at once (a ring of the last 64, 30 s), so
// a burst of one new prefix follows the first pick before the agent's
// update arrives. Choice.CachedBlocks tells how many blocks the chosen
// endpoint was believed to hold. A request without a Prefix is scored as
// below.
//
// # Score
//
// An endpoint that has been sent fewer than Config.ColdStartSamples (20)
// requests scores its weight alone. Requests are counted when picked, not
// when reported, so a burst of new sessions cannot pile onto a new
// endpoint beyond that many before its load counts. After that:
//
//	score = weight × successRate × loadFactor / latencyFactor
//
// successRate is (s+1)/(s+f+1), where s and f are the endpoint's successes
// and failures (endpoint failures and dead keys) decayed exponentially with
// a half-life of Config.SuccessHalfLife (1 minute). It follows recent
// behaviour rather than the lifetime average, and an endpoint that has been
// idle (for instance while its breaker was open) drifts back towards 1, so
// it recovers once healthy. Rate limits and client faults do not count: a
// 429 is handled by the breaker, and a client's bad request says nothing
// about the endpoint.
//
// loadFactor uses an expected load:
//
//	load = max(in flight, Health.Running, duty × sessions) + Health.Waiting
//
// Our own in-flight count is exact and immediate; gossip is late and
// includes our requests; the engine's queue is work ahead of ours.
// sessions is the number of live sessions mapped to the endpoint and duty
// the cluster-wide share of sessions with a request in flight (in-flight
// requests over live sessions, at most 1): between turns a chat session has
// nothing in flight, yet it will come back to this endpoint, so duty ×
// sessions is the load the endpoint's sessions keep sending. With a
// capacity, loadFactor = max(1 - load/Capacity, 0.01), the free share of the
// endpoint; without one, 1/(1+load). It is then multiplied by
// (1 - KVCacheUsage/2), so an engine whose cache is full receives fewer new
// sessions (each would evict someone else's prefix). Because the in-flight
// count rises at the moment of the pick, a burst of new sessions spreads
// over the endpoints instead of herding onto the current best, and because
// mapped sessions count, sessions arriving one by one between other
// sessions' turns spread too.
//
// latencyFactor = 1 + ewma/Config.LatencyScale (1 second), where ewma is
// the moving average ema = (1-a)·ema + a·sample with a = Config.EWMAAlpha
// (0.3), initialised by the first sample. A gentle divisor rather than the
// raw latency: measured latency mostly reflects each endpoint's mix of
// cache hits and misses, and raw ratios would swing placement far more than
// real speed differences justify. Samples come from successes; an endpoint
// failure contributes its latency only when it is above the average (a
// timeout is evidence of slowness; a fast error is no evidence of speed).
// An endpoint without samples has latencyFactor 1.
//
// Ties (scores within a relative 1e-9, which includes all endpoints of equal
// weight during cold start) go to the endpoint with fewer requests in
// flight, then uniformly at random (seeded by Config.Seed).
//
// # Circuit breaker
//
// Each endpoint has a breaker: closed, open or half-open. A closed breaker
// opens after Config.FailureThreshold (5) consecutive endpoint failures, or
// when endpoint failures make up at least Config.FailureRate (0.5) of the
// decayed window of successes and endpoint failures once that window holds
// Config.FailureRateMinSamples (10, never less than 2) outcomes; so the rate
// rule never fires on a first request. An open breaker admits nothing for
// Config.Cooldown (30 seconds), then turns half-open and admits at most
// Config.HalfOpenProbes (3) requests at a time. A failed probe re-opens it
// with a fresh cooldown; Config.HalfOpenProbes successful probes in a row
// close it and clear its failure window.
//
// A 429 opens the breaker at once for the upstream's Retry-After (capped at
// Config.MaxRetryAfter, 10 minutes) or Config.RateLimitCooldown (1 minute)
// when none was given; a 503 opens it at once for Config.Cooldown. When a
// breaker is already open, the later deadline wins. Reports of requests
// picked before the breaker last changed state do not move it (except 429
// and 503, which speak for the endpoint's present state), so a burst of
// late failures cannot re-open a breaker that probes just closed. Dead keys
// and client faults never touch the breaker; they only free a probe slot.
//
// # Outcome classes
//
// See Classify: 2xx success; 401/403 dead key; 429 rate limited; 5xx,
// timeouts and connection errors are endpoint failures; other 4xx, and the
// client cancelling, are client faults, which count against nothing and are
// not retried.
//
// # Health
//
// Draining endpoints get no new requests, including a session's
// follow-ups; suspect ones are avoided unless nothing else is allowed.
// Running, Waiting and KVCacheUsage feed the load factor and the saturation
// rule above. Health for an unknown endpoint is ignored.
//
// # Comparison policies
//
// Config.Policy selects the sticky policy (the default) or one of seven
// policies that exist to be measured against it. They share everything
// above except affinity and scoring: the same exclusions, avoidance,
// breaker, capacity and in-flight accounting, and the same session table
// (so they report hit and miss), but they choose differently.
// PolicyRoundRobin takes the next admitted endpoint in ID order after a
// per-model cursor; PolicyRandom a uniformly random one; PolicyLeastLoaded
// the one with the fewest requests in flight (random among ties);
// PolicyConsistentHash hashes the session key (FNV-1a) onto a ring of
// Config.VirtualNodes points per unit of weight (100) and walks clockwise to
// the first admitted endpoint, choosing at random when there is no key.
// PolicyPrefixHash does the same with the hash of the prefix's first 16
// blocks; PolicyDualMap takes the two endpoints of highest rendezvous hash
// with that prefix and the one with fewer requests in flight; PolicySGLang
// is SGLang's cache-aware router over an approximate per-endpoint tree (a
// BlockLRU of the prefixes routed there, 16 MiB of text): the longest match
// if it covers over 30% of the prompt, otherwise the endpoint with the
// smallest tree, and the shortest queue while the load is unbalanced (64
// and 1.5).
//
// # Priority tiers
//
// Endpoint.Priority puts an endpoint in a tier (0 first: home agents;
// higher: overflow, such as keyed provider APIs). Every policy above runs
// within one tier: the lowest tier that holds an endpoint admitted for the
// attempt, neither avoided (suspect, failed earlier in this request) nor
// reporting a saturated engine. When no tier has one, the pick uses the
// lowest tier with an admitted endpoint not to be avoided, else the lowest
// with any admitted endpoint. A session mapped outside the
// chosen tier is a miss, so sessions that overflowed return to the first
// tier once it has room. With a single tier nothing changes.
//
// # Keys
//
// An endpoint with Endpoint.Keys is reached with one of several
// credentials, and the DeadKeys and UsedKeys exclusions apply to each
// (endpoint, key) pair: Choice.Key names the key to use, the first in order
// that the attempt has not excluded and whose own breaker admits it. A 429
// opens that key's breaker for Retry-After (half-open afterwards, with the
// same bounded probes), not the endpoint's; 5xx answers, timeouts and
// connection failures count against the endpoint. The endpoint is excluded
// as a dead key once every key answered 401/403 in the request, and as a
// used key once every key answered 401/403 or 429 (one of them 429).
package scheduler
