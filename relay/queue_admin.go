package relay

import (
	"net/http"
	"slices"
	"strings"
)

// QueueStatus is the relay's queue as the admin API shows it (GET
// /admin/v1/queue): who waits for which model, and how long the oldest
// request of each has waited. Clients appear by name (a key without a
// name by a prefix of its digest), never by key.
type QueueStatus struct {
	// Enabled is false when the queue is off (Config.QueueWait < 0).
	Enabled bool `json:"enabled"`
	// Waiting is the requests waiting in all.
	Waiting int `json:"waiting"`
	// Flows are the clients with requests waiting, by model, class and
	// client.
	Flows []QueueFlow `json:"flows"`
}

// QueueFlow is one client's requests waiting for one model in one class.
type QueueFlow struct {
	Model  string `json:"model"`
	Class  string `json:"class"`
	Client string `json:"client"`
	Queued int    `json:"queued"`
	// OldestWaitMS is how long its oldest request has waited.
	OldestWaitMS int64 `json:"oldest_wait_ms"`
}

// QueueStatus returns the queue's state.
func (r *Relay) QueueStatus() QueueStatus {
	st := QueueStatus{Enabled: r.queue != nil, Flows: []QueueFlow{}}
	if r.queue == nil {
		return st
	}
	for _, f := range r.queue.q.Snapshot() {
		model, _, _ := strings.Cut(f.Model, "\x00")
		client := f.Flow
		if strings.HasPrefix(client, "ip-") {
			client = "anonymous" // a client's address is not the operator's view's business
		}
		st.Flows = append(st.Flows, QueueFlow{Model: model, Class: f.Band.String(), Client: client,
			Queued: f.Queued, OldestWaitMS: f.OldestWait.Milliseconds()})
		st.Waiting += f.Queued
	}
	slices.SortStableFunc(st.Flows, func(a, b QueueFlow) int { return strings.Compare(a.Model, b.Model) })
	return st
}

func (r *Relay) serveQueueStatus(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, r.QueueStatus())
}
