// Package ledger keeps the relay's account of usage: who used what (per
// client, model and hour), who served what (per agent or provider endpoint,
// model and hour), what it cost and what the KV cache saved. It keeps
// aggregates, never one row per request, and no secret: clients are known
// by name (a key without a name by its digest's name), never by key.
//
// # Recording
//
// Record adds one answered request to an in-memory accumulator: striped by
// client, so recording takes one uncontended lock and a few map lookups and
// allocates nothing once a row exists. A background flusher moves the
// accumulated deltas into the store every Config.FlushInterval (2 s by
// default), in one transaction that adds them to their hourly rows and to
// the daily rows that contain those hours.
//
// # Durability
//
// A flush takes the pending deltas out of the accumulator before it
// commits them, and numbers them: the store records the number of the last
// batch it applied in the same transaction. A process that dies before the
// commit is durable loses that batch: the counts of one flush interval plus
// the commit in flight. One that dies after it has nothing left to apply
// again: nothing of a batch outlives the process but the commit itself. A
// commit that fails is retried with the same number after the file is
// opened afresh, so a commit that reached the disk but reported an error is
// not applied twice. A restart continues the totals.
//
// # Bounds
//
// Client, agent and provider names come from the relay's configuration
// and membership. Model names come from clients, so they are capped: at
// most Config.MaxModelsPerHour distinct model names per hour, and at most
// Config.MaxRowsPerHour rows of each kind per hour in the accumulator; past
// those, a request is counted in a row whose model (then also whose name)
// is Other. The file keeps at most Config.MaxNames distinct names, hourly
// rows for Config.HourlyRetention (90 days) and daily rows for
// Config.DailyRetention (2 years).
//
// # Faults
//
// A file that cannot be opened or written (corrupt, locked, disk full)
// does not stop recording: counts wait in memory (bounded by
// Config.MaxPendingRows) while the flusher retries, Health reports the
// error, and budgets fail open or closed as Config.FailClosed says.
//
// # Budgets
//
// Check is the pure budget decision: a client's budget, its usage in the
// current UTC day and month (its own, as Spent reports it including what
// is not flushed yet, plus what peer relays report through SetPeer), and
// the time, give whether a request is over budget and when the budget
// resets.
package ledger
