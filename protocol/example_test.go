package protocol_test

import (
	"fmt"

	"github.com/dispenser-dev/dispenser/protocol"
)

// A reply in the range format, written by a worker and read back by a
// client that asked for five IDs.
func Example() {
	body := protocol.AppendRuns(nil, protocol.FormatRange, []protocol.Run{{First: 1001, Last: 1003}, {First: 2001, Last: 2002}})
	fmt.Printf("%s\n", body)
	runs, err := protocol.ParseIDs(body, 5, protocol.FormatRange, protocol.MinSegmentID)
	fmt.Println(runs, err)
	_, err = protocol.ParseIDs(body, 4, protocol.FormatRange, protocol.MinSegmentID)
	fmt.Println(err)
	// Output:
	// 1001-1003
	// 2001-2002
	// [{1001 1003} {2001 2002}] <nil>
	// protocol: bad IDs: line 2 "2001-2002": more IDs than the 4 asked for
}
