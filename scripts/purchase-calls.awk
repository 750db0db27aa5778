# The EVALSHA calls of scripts/purchase-script-cost and purchase-script-instructions: CALLS
# calls of BATCH attempts by new buyers (one unit each, no token, no deadline in reach) on
# the sale under the key prefix K. Variables: calls, batch, sha, k, rate ("interval
# tolerance" in ms), resends and form (each "-" for a script from before that argument).
BEGIN {
  user = 0
  for (c = 0; c < calls; c++) {
    line = "EVALSHA " sha " " (5 + batch)
    line = line " " k ":sale " k ":buyers " k ":orders " k ":accepted " k ":rate"
    for (i = 0; i < batch; i++) line = line " " k ":sale"
    line = line " 1 " rate
    if (resends != "-") line = line " " resends
    if (form != "-") line = line " " form
    for (i = 0; i < batch; i++) { user++; line = line " " user " 1 " (1000000000000 + user) " 0 99999999999999" }
    print line
  }
}
