package ledger

import "time"

// The ledger's periods: UTC hours and days as numbers since the Unix epoch,
// and UTC calendar months as year*12 + month - 1.

const (
	secondsPerHour = 3600
	secondsPerDay  = 24 * secondsPerHour
	hoursPerDay    = 24
)

func floorDiv(a, b int64) int64 {
	q := a / b
	if a%b != 0 && (a < 0) != (b < 0) {
		q--
	}
	return q
}

// hourOf returns the UTC hour number of t.
func hourOf(t time.Time) int64 { return floorDiv(t.Unix(), secondsPerHour) }

// dayOf returns the UTC day number of t.
func dayOf(t time.Time) int64 { return floorDiv(t.Unix(), secondsPerDay) }

// monthOf returns the UTC month number of t.
func monthOf(t time.Time) int32 {
	y, m, _ := t.UTC().Date()
	return int32(y*12 + int(m) - 1)
}

// hourTime, dayTime and monthTime return a period's start.
func hourTime(h int64) time.Time { return time.Unix(h*secondsPerHour, 0).UTC() }
func dayTime(d int64) time.Time  { return time.Unix(d*secondsPerDay, 0).UTC() }
func monthTime(m int32) time.Time {
	return time.Date(int(m/12), time.Month(m%12+1), 1, 0, 0, 0, 0, time.UTC)
}
