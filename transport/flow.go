package transport

import (
	"strconv"
	"strings"

	"github.com/computeflux/computeflux/scheduler"
)

// HeaderFlow is the request header in which a relay names the client a
// request is for, its weight and class and the request's cost in tokens:
// "client=NAME, weight=W, class=interactive|batch, cost=TOKENS". The
// agent orders the requests waiting for its engine by it and does not
// pass it on.
const HeaderFlow = "X-Computeflux-Flow"

// Flow is what HeaderFlow carries.
type Flow struct {
	// Client names the client; empty means the relay alone.
	Client string
	// Weight is the client's share; non-positive means 1.
	Weight float64
	// Class is the client's band.
	Class scheduler.Band
	// Cost is the request's expected tokens; non-positive means 1.
	Cost float64
}

// String formats f for HeaderFlow.
func (f Flow) String() string {
	var b strings.Builder
	b.Grow(len(f.Client) + 64)
	b.WriteString("client=")
	b.WriteString(f.Client)
	b.WriteString(", weight=")
	b.WriteString(strconv.FormatFloat(f.Weight, 'g', 6, 64))
	b.WriteString(", class=")
	b.WriteString(f.Class.String())
	b.WriteString(", cost=")
	b.WriteString(strconv.FormatFloat(f.Cost, 'f', 0, 64))
	return b.String()
}

// ParseFlow reads HeaderFlow's value. Unknown or malformed parts are left
// at their zero values: a relay of another version still gets served.
func ParseFlow(s string) Flow {
	var f Flow
	for part := range strings.SplitSeq(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(part), "=")
		if !ok {
			continue
		}
		switch k {
		case "client":
			if len(v) <= 256 {
				f.Client = v
			}
		case "weight":
			f.Weight, _ = strconv.ParseFloat(v, 64)
		case "class":
			f.Class, _ = scheduler.ParseBand(v)
		case "cost":
			f.Cost, _ = strconv.ParseFloat(v, 64)
		}
	}
	return f
}
