// Package scheduler picks which agent serves each inference request.
package scheduler
