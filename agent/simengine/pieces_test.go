package simengine

import (
	"slices"
	"testing"
)

func TestNewPiecesNeverGoesBack(t *testing.T) {
	p := []string{"a", "b", "c", "d"}
	for _, c := range []struct {
		sent, ready int
		want        []string
	}{
		{0, 2, []string{"a", "b"}},
		{2, 4, []string{"c", "d"}},
		{4, 0, nil},                // the engine's count read 0 after the answer ended
		{3, 2, nil},                // or lower than what was sent
		{2, 9, []string{"c", "d"}}, // more than the answer holds
		{4, 4, nil},
	} {
		if got := newPieces(p, c.sent, c.ready); !slices.Equal(got, c.want) {
			t.Errorf("newPieces(sent %d, ready %d) = %q, want %q", c.sent, c.ready, got, c.want)
		}
	}
}
