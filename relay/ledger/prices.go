package ledger

import (
	"fmt"
	"math"
)

// Prices are a provider endpoint's prices per million tokens, in the
// operator's currency. The zero value prices nothing at zero.
type Prices struct {
	// Input is the price of a prompt token the endpoint did not have in
	// its cache.
	Input float64 `json:"input"`
	// CachedInput is the price of a cached prompt token. The endpoints
	// file sets it to Input when it gives none (no discount).
	CachedInput float64 `json:"cached_input"`
	// Output is the price of a completion token.
	Output float64 `json:"output"`
}

// MaxPrice bounds a price per million tokens.
const MaxPrice = 1e6

// Validate reports a negative, infinite or absurd price.
func (p Prices) Validate() error {
	for _, f := range []struct {
		name string
		v    float64
	}{{"input", p.Input}, {"cached_input", p.CachedInput}, {"output", p.Output}} {
		if !(f.v >= 0) || f.v > MaxPrice {
			return fmt.Errorf("%s: must be a number from 0 to %g (per million tokens), got %v", f.name, float64(MaxPrice), f.v)
		}
	}
	return nil
}

// Cost returns what a request of prompt tokens (cached of them from the
// cache) and completion tokens costs at p, and what the cache saved
// against paying Input for every prompt token. A price above Input for
// cached tokens saves nothing (not less than nothing).
func (p Prices) Cost(prompt, cached, completion int64) (cost, saved Money) {
	// Prices are per million tokens and Money is a billionth: a token at
	// price x costs x*1000 Money.
	c := (float64(prompt-cached)*p.Input + float64(cached)*p.CachedInput + float64(completion)*p.Output) * 1e3
	s := float64(cached) * (p.Input - p.CachedInput) * 1e3
	return roundMoney(c), roundMoney(math.Max(s, 0))
}
