package transport

// HeaderUsage carries, between a relay and an agent, who strips the usage
// chunk an agent asks its engine for on a stream whose client did not ask
// for one. A relay that counts usage sends UsageKeep on its request: the
// agent then passes the chunk on and answers with UsageAdded, and the
// relay reads the chunk and drops it. Without UsageKeep (a relay of an
// older version) the agent drops the chunk itself, as before.
const HeaderUsage = "X-Computeflux-Usage"

// Values of HeaderUsage.
const (
	// UsageKeep, on a request: pass an added usage chunk on.
	UsageKeep = "keep"
	// UsageAdded, on an answer: its usage chunk was not asked for by the
	// client.
	UsageAdded = "added"
)
