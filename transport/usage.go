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

// HeaderAPIMissing is set by an agent on its answer to a request for an
// optional API (JoinInfo.UnknownAPIs) that its engine turned out not to
// serve: the engine's own 404 or 405, read as a missing route. The relay
// then tries another endpoint, as for an agent that never listed the
// path; the agent's next update drops it from UnknownAPIs.
const HeaderAPIMissing = "X-Computeflux-Api-Missing"
