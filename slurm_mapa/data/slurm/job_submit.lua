--[[
slurm-mapa job_submit plugin: validates MAPA directives when a job is submitted.

Install as /etc/slurm/job_submit.lua (next to slurm.conf) with JobSubmitPlugins=lua. Written for
Lua 5.1, the version Debian's slurm-wlm-basic-plugins links (Slurm 24.11 and 26.05).

What it does (docs/directives.md describes the grammar for users):

* A batch job's `#MAPA key=value ...` lines are read from job_desc.script with sbatch's rule for
  #SBATCH: only the lines before the first command count. srun/salloc jobs have no script; they
  give `--comment=mapa:key=value ...`. Both are validated when both are present; the comment
  wins, as in the Prolog.
* A bad directive rejects the job: slurm.log_user() gets the message (sbatch prints
  "sbatch: error: MAPA: ...") and the return code is ESLURM_INVALID_GRES ("Invalid generic resource
  (gres) specification"; slurm.ERROR where that code is missing).
* A good one is put where the Prolog reads it without asking slurmctld, the job comment (which
  slurmd hands the Prolog as SLURM_JOB_COMMENT): "mapa:<normalised>" when the user gave no
  comment, the user's own text followed by " [mapa:<normalised>]" otherwise (a user's `mapa:`
  comment stays as it is; a comment that would pass _MAX_LINE_CHARS stays too, and the Prolog
  then reads the batch script). It is also stored in normalised form as job_desc.admin_comment =
  "mapa:<normalised>", which sacct keeps. Jobs without a directive are left untouched. Text already in
  admin_comment (an admin's, or another plugin's) is kept in front of MAPA's record, with the rule
  of slurm_mapa/slurm/text/decision.py (find_record): MAPA's record starts at the first "mapa:" that
  begins the text or follows whitespace, starts within the first _MAX_RECORD_SCAN_CHARS bytes and
  whose text up to the next '#' parses as a directive, however many other "mapa:" words come
  before it; an older MAPA record found that way is replaced, with what follows it. When the
  result would pass _MAX_ADMIN_COMMENT_CHARS, admin_comment is left as it was (the Prolog reads
  the directive from the comment or the script then).
* Slurm 24.11 ACCEPTS a job when the Lua function raises a runtime error (26.05 rejects it with the
  raw Lua error), so everything runs under pcall: an internal error rejects the job with a message
  that says so (ESLURM_INTERNAL, or slurm.ERROR), on either release.
* slurm_job_modify validates a changed comment's directive (`mapa:` or " [mapa:...]") the same
  way (the Prolog reads the job comment first) and rejects a bad one; it never rewrites admin_comment, because a user may not
  set it on modify. Other modifications, the Prolog's own AdminComment updates included, pass.

This is a line-by-line port of slurm_mapa/slurm/text/directive.py (parse_comment and
parse_directive_lines, with the checks of Directive): same order of checks, same limits, same
message text; tests/slurm/admin/test_job_submit_lua.py runs both over tests/data/directives/corpus.tsv and
compares them. One difference by design: Slurm hands Lua bytes, so lengths and columns count bytes
and a refused byte is shown as '\xHH' (Python counts characters of the decoded text).

All input is bounded before any per-character work (8192 bytes per line or comment, 16 lines,
64 tokens, 2048 list items); the only patterns used on user text are anchored or single-class
scans, which are linear in the input.
--]]

local _KEYWORD = "#MAPA"
local _COMMENT_PREFIX = "mapa:"
local _SUFFIX_OPEN = " [mapa:"
local _SUFFIX_CLOSE = "]"
local _MAX_PATTERN_GPUS = 64
local _MAX_LINE_CHARS = 8192 -- one #MAPA line, or one mapa: comment
local _MAX_DIRECTIVE_LINES = 16 -- #MAPA lines in one script
local _MAX_TOKENS = 64 -- key=value tokens in one directive (all lines together)
local _MAX_LIST_ITEMS = 2048 -- items in edges= or weights=
local _MAX_WEIGHT_DIGITS = 6 -- digits before and after the decimal point of a weight
local _MAX_ADMIN_COMMENT_CHARS = 16384 -- as decision.py's MAX_ADMIN_COMMENT_CHARS
-- As decision.py's MAX_RECORD_SCAN_CHARS: only a "mapa:" starting in the first 64 Ki bytes can be
-- MAPA's record (here bytes; admin_comment is only read when it holds at most
-- _MAX_ADMIN_COMMENT_CHARS bytes, so the bound never cuts what the plugin reads).
local _MAX_RECORD_SCAN_CHARS = 65536
-- Node choice (docs/admin.md, "Choosing the node"): the GPU counts mapa-agent publishes node
-- features for, as mapa.toml's [features] sizes, e.g. { 2, 4, 8 }. Empty: no preference is added.
-- `mapa job-submit-lua PATH` writes this file with both lines set from mapa.toml.
local _NODE_FEATURE_SIZES = {}
-- What insensitive jobs (and jobs without a directive) prefer: "none" (nothing; the default) or
-- "noring" (mapa_noring<k>: they keep off the nodes with a good k-ring free, the replay study's
-- best choice, but on a cluster where every node has a good ring free they then wait for the
-- backfill scheduler: Slurm's main scheduler skips a job whose preferred feature no node has).
local _INSENSITIVE_JOBS = "none"

local _KEYS = { "topology", "sensitive", "gpus", "edges", "weights", "placement", "wait" }
local _PLACEMENTS = { "prefer", "require", "any" }
local _PLACEMENT_LIST = table.concat(_PLACEMENTS, ", ")
local _DEFAULT_REQUIRE_WAIT = 30 -- minutes a placement=require job holds out for a good node
local _MAX_WAIT_MINUTES = 1440
local _SHAPES = { "ring", "chain", "tree", "ring+tree", "all", "star", "mesh2d", "torus2d", "hypercube", "custom" }
local _KEY_LIST = table.concat(_KEYS, ", ")
local _SHAPE_LIST = table.concat(_SHAPES, ", ")
local _TRUE_WORDS = { yes = true, ["true"] = true, ["1"] = true }
local _FALSE_WORDS = { no = true, ["false"] = true, ["0"] = true }
local _GRID_SHAPES = { mesh2d = true, torus2d = true }

local function _set_of(list)
    local set = {}
    for _, item in ipairs(list) do
        set[item] = true
    end
    return set
end

local _KEY_SET = _set_of(_KEYS)
local _SHAPE_SET = _set_of(_SHAPES)
local _PLACEMENT_SET = _set_of(_PLACEMENTS)

-- ASCII-only case mapping: string.lower/upper follow the C locale of slurmctld.
local _TO_LOWER, _TO_UPPER = {}, {}
for code = 65, 90 do
    _TO_LOWER[string.char(code)] = string.char(code + 32)
    _TO_UPPER[string.char(code + 32)] = string.char(code)
end

local function _lower(text)
    return (string.gsub(text, "[A-Z]", _TO_LOWER))
end

local function _upper(text)
    return (string.gsub(text, "[a-z]", _TO_UPPER))
end

local function _int(number)
    return string.format("%d", number)
end

local function _q(text)
    return "'" .. text .. "'"
end

-- A user error is raised as a table with this metatable; anything else raised is a bug.
local _INVALID = {}

local function _fail(message, line)
    local where = ""
    if line ~= nil then
        where = "line " .. _int(line) .. ": "
    end
    error(setmetatable({ message = "MAPA: " .. where .. message }, _INVALID), 0)
end

-- How Python's ascii() writes one refused character (a byte here).
local function _ascii(code)
    if code == 10 then
        return "'\\n'"
    elseif code == 13 then
        return "'\\r'"
    elseif code == 9 then
        return "'\\t'"
    end
    return string.format("'\\x%02x'", code)
end

local function _check_line(text, line)
    if #text > _MAX_LINE_CHARS then
        _fail("directive text is " .. _int(#text) .. " characters long (accepted: at most " .. _int(_MAX_LINE_CHARS) .. ")", line)
    end
    local column = string.find(text, "[^\t -~]")
    if column then
        _fail("character " .. _ascii(string.byte(text, column)) .. " at column " .. _int(column)
            .. " is not accepted (accepted: printable ASCII, spaces and tabs)", line)
    end
end

-- The key=value tokens of a checked body (only spaces and tabs are left); '#' starts a comment.
local function _tokens(body)
    local tokens = {}
    for token in string.gmatch(body, "[^ \t]+") do
        if string.sub(token, 1, 1) == "#" then
            break
        end
        tokens[#tokens + 1] = token
    end
    return tokens
end

local function _split_list(value, key, line)
    local count, position = 1, string.find(value, ",", 1, true)
    while position do
        count = count + 1
        position = string.find(value, ",", position + 1, true)
    end
    if count > _MAX_LIST_ITEMS then
        _fail(key .. "= has " .. _int(count) .. " items (accepted: at most " .. _int(_MAX_LIST_ITEMS) .. ")", line)
    end
    local items, start = {}, 1
    while true do
        local comma = string.find(value, ",", start, true)
        if not comma then
            items[#items + 1] = string.sub(value, start)
            return items
        end
        items[#items + 1] = string.sub(value, start, comma - 1)
        start = comma + 1
    end
end

-- Value parsers: return (parsed value, canonical text), or fail with the line number.

local function _parse_topology(value, line)
    local lowered = _lower(value)
    local shape, grid_text = lowered, nil
    local colon = string.find(lowered, ":", 1, true)
    if colon then
        shape, grid_text = string.sub(lowered, 1, colon - 1), string.sub(lowered, colon + 1)
    end
    if not _SHAPE_SET[shape] then
        _fail("unknown topology " .. _q(value) .. " (accepted: " .. _SHAPE_LIST .. ")", line)
    end
    if not colon then
        return { shape = shape }, shape
    end
    if not _GRID_SHAPES[shape] then
        _fail("a grid like ':" .. grid_text .. "' is only accepted with mesh2d and torus2d, not topology="
            .. value .. " (accepted: mesh2d:RxC, torus2d:RxC)", line)
    end
    local rows, cols = 0, 0
    local row_text, col_text = string.match(grid_text, "^([0-9][0-9]?)x([0-9][0-9]?)$")
    if row_text then
        rows, cols = tonumber(row_text), tonumber(col_text)
    end
    if math.min(rows, cols) < 1 or rows * cols > _MAX_PATTERN_GPUS then
        _fail("bad grid " .. _q(grid_text) .. " in topology=" .. value .. " (accepted: RxC of positive whole numbers, at most "
            .. _int(_MAX_PATTERN_GPUS) .. " GPUs, e.g. " .. shape .. ":2x4)", line)
    end
    return { shape = shape, rows = rows, cols = cols }, shape .. ":" .. _int(rows) .. "x" .. _int(cols)
end

local function _parse_sensitive(value, line)
    local lowered = _lower(value)
    if _TRUE_WORDS[lowered] then
        return true, "yes"
    elseif _FALSE_WORDS[lowered] then
        return false, "no"
    end
    _fail("bad value " .. _q(value) .. " for sensitive (accepted: yes, no, true, false, 1, 0)", line)
end

local function _parse_gpus(value, line)
    if string.find(value, "^[0-9][0-9]?[0-9]?[0-9]?$") then
        local number = tonumber(value)
        if number >= 1 and number <= _MAX_PATTERN_GPUS then
            return number, _int(number)
        end
    end
    _fail("bad value " .. _q(value) .. " for gpus (accepted: a whole number from 1 to " .. _int(_MAX_PATTERN_GPUS) .. ")", line)
end

local function _parse_edges(value, line)
    local edges, texts = {}, {}
    for _, item in ipairs(_split_list(value, "edges", line)) do
        local a, b = -1, _MAX_PATTERN_GPUS
        local a_text, b_text = string.match(item, "^([0-9][0-9]?)%-([0-9][0-9]?)$")
        if a_text then
            a, b = tonumber(a_text), tonumber(b_text)
        end
        if math.max(a, b) >= _MAX_PATTERN_GPUS then
            _fail("bad edge " .. _q(item) .. " in edges= (accepted: comma-separated pairs like 0-1 of GPU numbers 0 to "
                .. _int(_MAX_PATTERN_GPUS - 1) .. ")", line)
        end
        if a == b then
            _fail("edge " .. _q(item) .. " links a GPU to itself (accepted: pairs of two different GPUs)", line)
        end
        edges[#edges + 1] = { a, b }
        texts[#texts + 1] = _int(a) .. "-" .. _int(b)
    end
    return edges, table.concat(texts, ",")
end

-- The canonical text of a weight W = digits{1,6} ['.' digits{1,6}], or nil when W is not one or
-- is zero. Python writes the shortest decimal of float(W); for at most 12 significant digits
-- that is W without leading zeros before the point and without trailing zeros after it.
local function _weight_text(item)
    local whole, fraction = item, nil
    local point = string.find(item, ".", 1, true)
    if point then
        whole, fraction = string.sub(item, 1, point - 1), string.sub(item, point + 1)
    end
    if #whole < 1 or #whole > _MAX_WEIGHT_DIGITS or not string.find(whole, "^[0-9]+$") then
        return nil
    end
    if fraction ~= nil and (#fraction < 1 or #fraction > _MAX_WEIGHT_DIGITS or not string.find(fraction, "^[0-9]+$")) then
        return nil
    end
    whole = string.match(whole, "^0*(.-)$")
    fraction = string.match(fraction or "", "^(.-)0*$")
    if whole == "" and fraction == "" then
        return nil -- zero
    end
    if whole == "" then
        whole = "0"
    end
    if fraction == "" then
        return whole
    end
    return whole .. "." .. fraction
end

local function _parse_weights(value, line)
    local texts = {}
    for _, item in ipairs(_split_list(value, "weights", line)) do
        local text = _weight_text(item)
        if not text then
            _fail("bad weight " .. _q(item) .. " in weights= (accepted: positive decimal numbers like 4 or 0.5, at most "
                .. _int(_MAX_WEIGHT_DIGITS) .. " digits before and after the point)", line)
        end
        texts[#texts + 1] = text
    end
    return texts, table.concat(texts, ",")
end

local function _parse_placement(value, line)
    local lowered = _lower(value)
    if _PLACEMENT_SET[lowered] then
        return lowered, lowered
    end
    _fail("bad value " .. _q(value) .. " for placement (accepted: " .. _PLACEMENT_LIST .. ")", line)
end

local function _parse_wait(value, line)
    if string.find(value, "^[0-9][0-9]?[0-9]?[0-9]?[0-9]?$") then
        local number = tonumber(value)
        if number >= 1 and number <= _MAX_WAIT_MINUTES then
            return number, _int(number)
        end
    end
    _fail("bad value " .. _q(value) .. " for wait (accepted: whole minutes from 1 to " .. _int(_MAX_WAIT_MINUTES) .. ")", line)
end

local _VALUE_PARSERS = {
    topology = _parse_topology,
    sensitive = _parse_sensitive,
    gpus = _parse_gpus,
    edges = _parse_edges,
    weights = _parse_weights,
    placement = _parse_placement,
    wait = _parse_wait,
}

-- The number of edges of a shape over `size` GPUs (slurm_mapa.core.patterns.make_pattern).
local function _edge_count(shape, size, rows, cols, edges)
    if shape == "ring" then
        if size == 1 then
            return 0
        elseif size == 2 then
            return 2 -- both directions over the one link
        end
        return size
    elseif shape == "chain" or shape == "tree" or shape == "star" then
        return size - 1
    elseif shape == "ring+tree" then
        return _edge_count("ring", size) + size - 1
    elseif shape == "all" then
        return size * (size - 1) / 2
    elseif shape == "mesh2d" or shape == "torus2d" then
        if rows == nil then -- the squarest grid: R x C, R <= C, R as large as possible
            rows = 1
            local r = 1
            while r * r <= size do
                if size % r == 0 then
                    rows = r
                end
                r = r + 1
            end
            cols = size / rows
        end
        local across, down = cols - 1, rows - 1
        if shape == "torus2d" then
            if cols > 1 then
                across = across + 1
            end
            if rows > 1 then
                down = down + 1
            end
        end
        return rows * across + cols * down
    elseif shape == "hypercube" then
        local dims = 0
        while 2 ^ dims < size do
            dims = dims + 1
        end
        return size * dims / 2
    end
    return #edges -- custom
end

local function _is_power_of_two(number)
    while number > 1 and number % 2 == 0 do
        number = number / 2
    end
    return number == 1
end

local function _weights_count_message(given, edges, what)
    return _int(given) .. " weights given for the " .. _int(edges) .. " edges of " .. what
        .. " (accepted: one weight per edge, in the pattern's edge order)"
end

-- The checks of a directive against a GPU count (Python: _check_size).
local function _check_size(d, size)
    if d.rows ~= nil and d.rows * d.cols ~= size then
        _fail("topology=" .. d.topology .. ":" .. _int(d.rows) .. "x" .. _int(d.cols) .. " needs "
            .. _int(d.rows * d.cols) .. " GPUs, got " .. _int(size))
    end
    if d.topology == "hypercube" and not _is_power_of_two(size) then
        _fail("a hypercube needs a power-of-two GPU count (accepted: 1, 2, 4, 8, 16, 32, 64), got " .. _int(size))
    end
    if d.edges ~= nil then
        for _, edge in ipairs(d.edges) do
            local top = math.max(edge[1], edge[2])
            if top >= size then
                _fail("edge '" .. _int(edge[1]) .. "-" .. _int(edge[2]) .. "' names GPU " .. _int(top)
                    .. ", outside 0.." .. _int(size - 1) .. " for " .. _int(size) .. " GPUs")
            end
        end
    end
    if d.weights ~= nil then
        local count = _edge_count(d.topology, size, d.rows, d.cols, d.edges)
        if count ~= #d.weights then
            _fail(_weights_count_message(#d.weights, count, d.topology .. " over " .. _int(size) .. " GPUs"))
        end
    end
end

-- Merge the tokens of one or more lines into the normalised directive text (Python: _build and
-- the checks of Directive). `lines` is a list of { tokens = {...}, line = number or nil }.
local function _build(lines)
    local seen, values, count = {}, {}, 0
    for _, entry in ipairs(lines) do
        local line = entry.line
        for _, token in ipairs(entry.tokens) do
            count = count + 1
            if count > _MAX_TOKENS then
                _fail("more than " .. _int(_MAX_TOKENS) .. " key=value tokens (accepted: at most " .. _int(_MAX_TOKENS) .. ")", line)
            end
            local equals = string.find(token, "=", 1, true)
            if not equals then
                _fail("token " .. _q(token) .. " is not key=value (accepted keys: " .. _KEY_LIST .. ")", line)
            end
            local written_key, value = string.sub(token, 1, equals - 1), string.sub(token, equals + 1)
            local key = _lower(written_key)
            if not _KEY_SET[key] then
                _fail("unknown key " .. _q(written_key) .. " in " .. _q(token) .. " (accepted: " .. _KEY_LIST .. ")", line)
            end
            if value == "" then
                _fail("empty value in " .. _q(token) .. " (accepted: key=value with a value)", line)
            end
            local parsed, canonical = _VALUE_PARSERS[key](value, line)
            if seen[key] then
                if seen[key].canonical ~= canonical then
                    _fail(key .. " given twice: " .. _q(seen[key].token) .. " and " .. _q(token)
                        .. " (accepted: each key once, or again with the same value)", line)
                end
            else
                seen[key] = { canonical = canonical, token = token }
                values[key] = parsed
            end
        end
    end

    local topology = values.topology or { shape = "ring" }
    local d = {
        topology = topology.shape,
        rows = topology.rows,
        cols = topology.cols,
        sensitive = values.sensitive == true,
        gpus = values.gpus,
        edges = values.edges,
        weights = values.weights,
    }
    if d.edges ~= nil then
        if d.topology ~= "custom" then
            _fail("edges= is only accepted with topology=custom, not topology=" .. d.topology)
        end
    elseif d.topology == "custom" then
        _fail("topology=custom needs edges=, e.g. edges=0-1,1-2 (accepted: comma-separated GPU pairs)")
    end
    local placement, wait = values.placement, values.wait
    if placement == "require" and not d.sensitive then
        _fail("placement=require needs sensitive=yes: an insensitive job has no good node to wait for "
            .. "(accepted: placement=prefer or placement=any without sensitive=yes)")
    end
    if wait ~= nil then
        if placement ~= "require" then
            _fail("wait= is only accepted with placement=require (accepted: placement=require wait=MINUTES)")
        end
    elseif placement == "require" then
        wait = _DEFAULT_REQUIRE_WAIT
    end
    local size = d.gpus
    if size == nil and d.rows ~= nil then
        size = d.rows * d.cols
    end
    if size ~= nil then
        _check_size(d, size)
    elseif d.edges ~= nil and d.weights ~= nil and #d.weights ~= #d.edges then
        _fail(_weights_count_message(#d.weights, #d.edges, "the custom edge list"))
    end

    local topology_text = d.topology
    if d.rows ~= nil then
        topology_text = topology_text .. ":" .. _int(d.rows) .. "x" .. _int(d.cols)
    end
    local parts = { "topology=" .. topology_text, "sensitive=" .. (d.sensitive and "yes" or "no") }
    for _, key in ipairs({ "gpus", "edges", "weights" }) do
        if seen[key] then
            parts[#parts + 1] = key .. "=" .. seen[key].canonical
        end
    end
    if placement ~= nil then
        parts[#parts + 1] = "placement=" .. placement
    end
    if wait ~= nil then
        parts[#parts + 1] = "wait=" .. _int(wait)
    end
    return table.concat(parts, " "), d
end

-- The normalised directive of a `mapa:` comment, or nil for any other comment.
local function _parse_comment(comment)
    local first = string.find(comment, "[^ \t]")
    if not first or _lower(string.sub(comment, first, first + #_COMMENT_PREFIX - 1)) ~= _COMMENT_PREFIX then
        return nil
    end
    _check_line(comment, nil) -- the whole comment, surrounding blanks included, is bounded
    return _build({ { tokens = _tokens(string.sub(comment, first + #_COMMENT_PREFIX)), line = nil } })
end

-- (the user's text, the body) of a comment ending in " [mapa:BODY]", else nil (directive.py's
-- _split_suffix). Only the last _MAX_LINE_CHARS + 8 bytes are searched: a body is never longer.
local function _split_suffix(comment)
    if string.sub(comment, -1) ~= _SUFFIX_CLOSE then
        return nil
    end
    local start, position = nil, math.max(1, #comment - (_MAX_LINE_CHARS + #_SUFFIX_OPEN + 1) + 1)
    while true do
        local found = string.find(comment, _SUFFIX_OPEN, position, true)
        if not found then
            break
        end
        start, position = found, found + 1
    end
    if not start then
        return nil
    end
    local body = string.sub(comment, start + #_SUFFIX_OPEN, -2)
    if string.find(body, _SUFFIX_CLOSE, 1, true) then
        return nil
    end
    return string.sub(comment, 1, start - 1), body
end

-- The normalised directive a comment carries: a whole `mapa:` comment, or the " [mapa:BODY]"
-- this plugin puts after the user's own text; nil for any other comment.
local function _directive_in_comment(comment)
    local directive = _parse_comment(comment)
    if directive ~= nil then
        return directive
    end
    local _, body = _split_suffix(comment)
    if body == nil then
        return nil
    end
    _check_line(body, nil)
    return _build({ { tokens = _tokens(body), line = nil } })
end

local function _directive_in_comment_safe(comment)
    local ok, directive = pcall(_directive_in_comment, comment)
    return ok and directive or nil
end

-- The comment to leave on a job with this directive (directive.py's comment_with_directive), or
-- nil to leave it as it is. The Prolog finds the directive there, in SLURM_JOB_COMMENT, without
-- asking slurmctld.
local function _comment_with_directive(comment, directive)
    if comment == nil then
        return _COMMENT_PREFIX .. directive
    end
    if _parse_comment(comment) ~= nil then
        return nil
    end
    local user = _split_suffix(comment) or comment
    local text = user .. _SUFFIX_OPEN .. directive .. _SUFFIX_CLOSE
    if #text > _MAX_LINE_CHARS or text == comment then
        return nil
    end
    return text
end

-- Whether existing[start, stop) ("mapa:" up to the next '#', or the end) parses as a directive
-- (decision.py's _is_record). A text too long, or with a byte no directive has, is refused
-- before it is copied or parsed.
local function _is_record(existing, start, stop)
    if stop - start > _MAX_LINE_CHARS then
        return false
    end
    local text = string.sub(existing, start, stop - 1)
    if string.find(text, "[^\t -~]") then
        return false
    end
    return (pcall(_parse_comment, text))
end

-- Where MAPA's record starts in an admin_comment, or nil (decision.py's find_record): the first
-- "mapa:" (any case) that begins the text or follows whitespace, starts within the first
-- _MAX_RECORD_SCAN_CHARS bytes and whose text up to the next '#' parses, however many other
-- "mapa:" words come before it. Linear in the text: of the candidates before one '#' only the last
-- is parsed. An earlier one's text up to that '#' holds the later "mapa:" word after a blank, and
-- no directive has a token starting with "mapa:" (its key would hold a ':'), so it could not
-- parse; the texts parsed are disjoint, and each at most _MAX_LINE_CHARS long.
local function _record_start(existing)
    local limit = _MAX_RECORD_SCAN_CHARS + #_COMMENT_PREFIX - 1 -- a "mapa:" starting there still fits
    local lowered = _lower(string.sub(existing, 1, limit))
    local position, segment_end, pending = 1, 0, nil -- segment_end: the current segment's '#', or #existing + 1
    while true do
        local found = string.find(lowered, _COMMENT_PREFIX, position, true)
        if not found then
            break
        end
        if found == 1 or string.find(string.sub(existing, found - 1, found - 1), "^[ \t\r\n\f\v]$") then
            if found > segment_end then -- a new segment: the pending candidate is the last of its own
                if pending and _is_record(existing, pending, segment_end) then
                    return pending
                end
                segment_end = string.find(existing, "#", found, true) or #existing + 1
            end
            pending = found
        end
        position = found + #_COMMENT_PREFIX
    end
    if pending and _is_record(existing, pending, segment_end) then
        return pending
    end
    return nil
end

-- The admin's text in an existing admin_comment: what precedes MAPA's record (_record_start), or
-- all of it, without outer whitespace.
local function _admin_text(existing)
    local cut = _record_start(existing) or #existing + 1
    local first, last = string.find(existing, "[^ \t\r\n\f\v]"), cut - 1
    while last > 0 and string.find(string.sub(existing, last, last), "^[ \t\r\n\f\v]$") do
        last = last - 1
    end
    if not first or first > last then
        return ""
    end
    return string.sub(existing, first, last)
end

local function _is_near_miss(line, first)
    if _upper(string.sub(line, first, first + #_KEYWORD - 1)) ~= _KEYWORD then
        return false
    end
    local after = string.sub(line, first + #_KEYWORD, first + #_KEYWORD)
    return after == "" or after == " " or after == "\t" or after == ":" or after == "="
end

-- The normalised directive of a batch script's #MAPA lines, or nil when it has none. As sbatch
-- does for #SBATCH, reading stops at the first line that is neither blank nor a comment.
local function _parse_script(script)
    local found, number, start = {}, 0, 1
    while true do
        number = number + 1
        local newline = string.find(script, "\n", start, true)
        local line = string.sub(script, start, (newline or #script + 1) - 1)
        if string.sub(line, -1) == "\r" then
            line = string.sub(line, 1, -2)
        end
        local first = string.find(line, "[^ \t]")
        if first then
            if string.sub(line, first, first) ~= "#" then
                break -- the first command
            end
            local after = string.sub(line, #_KEYWORD + 1, #_KEYWORD + 1)
            if string.sub(line, 1, #_KEYWORD) == _KEYWORD and (after == "" or after == " " or after == "\t") then
                if #found == _MAX_DIRECTIVE_LINES then
                    _fail("more than " .. _int(_MAX_DIRECTIVE_LINES) .. " #MAPA lines (accepted: at most "
                        .. _int(_MAX_DIRECTIVE_LINES) .. ")", number)
                end
                _check_line(line, number)
                found[#found + 1] = { tokens = _tokens(string.sub(line, #_KEYWORD + 1)), line = number }
            elseif _is_near_miss(line, first) then
                _fail(_q(string.sub(line, first, first + #_KEYWORD - 1)) .. " here is not a directive "
                    .. "(accepted: '#MAPA' at the start of the line, then a space and key=value tokens)", number)
            end
        end
        if not newline then
            break
        end
        start = newline + 1
    end
    if #found == 0 then
        return nil
    end
    return _build(found)
end

-- A string field of job_desc, or nil (unset fields are nil; anything else is ignored).
local function _string_field(job_desc, name)
    if job_desc == nil then
        return nil
    end
    local value = job_desc[name]
    if type(value) == "string" and value ~= "" then
        return value
    end
    return nil
end

local function _rc(name)
    local rc = slurm[name]
    if type(rc) ~= "number" then
        rc = slurm.ERROR
    end
    return rc
end

-- Runs `check` under pcall; returns slurm.SUCCESS or rejects with a message for the user.
local function _guarded(what, check, ...)
    local ok, result = pcall(check, ...)
    if ok then
        return slurm.SUCCESS
    end
    if getmetatable(result) == _INVALID then
        pcall(slurm.log_user, "%s", result.message)
        pcall(slurm.log_debug, "MAPA: %s rejected: %s", what, result.message)
        return _rc("ESLURM_INVALID_GRES")
    end
    pcall(slurm.log_error, "MAPA: internal error in job_submit.lua (%s): %s", what, tostring(result))
    pcall(slurm.log_user, "%s", "MAPA: internal error while checking the job's MAPA directive; the job was "
        .. "not accepted. Please tell your Slurm administrator (details are in the slurmctld log).")
    return _rc("ESLURM_INTERNAL")
end

-- GPUs per node of a --gres=gpu[:type]:N or --gpus-per-node=N request (tres_per_node), else nil.
-- The GPU count of a TRES list ("gres/gpu:4", "gres/shard:1,gres/gpu:v100:4"), else nil.
local function _gpus_in_tres(tres)
    if not tres or #tres > 4096 then
        return nil
    end
    for item in string.gmatch(tres, "[^,]+") do
        local count = string.match(item, "^gres/gpu:(%d+)$") or string.match(item, "^gres/gpu:[%w_%.%-]+:(%d+)$")
        if count then
            return tonumber(count)
        end
    end
    return nil
end

local function _gpus_per_node(job_desc)
    return _gpus_in_tres(_string_field(job_desc, "tres_per_node"))
end

-- A constraint the preference can be merged with: feature names joined by '&', else nil.
local function _plain_and(text)
    if text and #text <= 1024 and string.find(text, "^[%w_%.%-]+$") then
        return text
    end
    if text and #text <= 1024 and string.find(text, "^[%w_%.%-]+&[%w_%.%-&]*[%w_%.%-]$")
        and not string.find(text, "&&", 1, true) then
        return text
    end
    return nil
end

local function _is_sensitive(directive)
    return string.find(" " .. directive .. " ", " sensitive=yes ", 1, true) ~= nil
end

local function _placement(directive)
    return string.match(" " .. directive .. " ", " placement=(%l+) ")
end

-- A begin time the user set (sbatch --begin), else nil.
local function _user_begin_time(job_desc)
    local value = job_desc.begin_time
    if type(value) == "number" and value > 0 and value ~= slurm.NO_VAL and value ~= slurm.NO_VAL64 then
        return value
    end
    return nil
end

-- Node choice for a k-GPU job, k one of _NODE_FEATURE_SIZES: a sensitive job prefers nodes with a
-- good k-ring free (mapa_ring<k>); with _INSENSITIVE_JOBS = "noring" an insensitive one, or one
-- without a directive, the others (mapa_noring<k>). placement=any adds nothing. The user's own
-- --prefer or nodes (-w) win; a --constraint of plain feature names joined by '&' is kept and the
-- MAPA feature added to the preference with it (unless it names a MAPA feature itself); any other
-- --constraint is left alone. Never a
-- constraint: Slurm (24.11, 26.05) fails a job whose constraint no node has active (BadConstraints), and
-- MAPA's features come and go.
-- placement=require also delays the job's start by wait= minutes (its begin time, which Slurm
-- itself enforces); `mapa release` on the controller starts it earlier, as soon as a node of its
-- partition has its feature. Only when `mapa release` can read the directive back from the job
-- comment (`readable`) and the user gave no --begin; otherwise it stays a preference.
local function _add_preference(job_desc, directive, readable)
    if #_NODE_FEATURE_SIZES == 0 or _string_field(job_desc, "prefer") or _string_field(job_desc, "req_nodes") then
        return -- nothing to steer, or the user chose: their own preference, or the nodes (-w)
    end
    local k, listed = _gpus_per_node(job_desc), false
    for _, size in ipairs(_NODE_FEATURE_SIZES) do
        listed = listed or size == k
    end
    local user = _string_field(job_desc, "features")
    if not listed or (user and not _plain_and(user)) then
        return
    end
    if user and string.find("&" .. user .. "&", "&mapa_n?o?ring%d+&") then
        return -- the user's --constraint names a MAPA feature already: they chose (no "mapa_ring2&mapa_ring2")
    end
    if directive ~= nil and _placement(directive) == "any" then
        return
    end
    local feature = "mapa_ring" .. _int(k)
    if directive == nil or not _is_sensitive(directive) then
        if _INSENSITIVE_JOBS ~= "noring" then
            return
        end
        feature = "mapa_noring" .. _int(k)
    end
    local wanted = feature
    if user then
        wanted = user .. "&" .. feature
    end
    job_desc.prefer = wanted
    if directive ~= nil and _placement(directive) == "require" and readable and not _user_begin_time(job_desc) then
        local wait = tonumber(string.match(" " .. directive .. " ", " wait=(%d+) "))
        job_desc.begin_time = os.time() + wait * 60
    end
end

-- The job's GPUs on each node where the submission fixes them: --gres=gpu:N or --gpus-per-node=N
-- (tres_per_node), or --gpus=N on one node (-N 1), else nil.
local function _job_gpus_per_node(job_desc)
    local k = _gpus_per_node(job_desc)
    if k == nil and job_desc.max_nodes == 1 then
        k = _gpus_in_tres(_string_field(job_desc, "tres_per_job"))
    end
    return k
end

-- A directive whose GPU count cannot be the job's is refused here, not left to fall back at the
-- job's start: gpus= other than the job's GPUs per node, a grid or hypercube of another size.
local function _check_job_size(job_desc, directive)
    local k = _job_gpus_per_node(job_desc)
    if k == nil or k < 1 or k > _MAX_PATTERN_GPUS then
        return
    end
    local tokens = {}
    for token in string.gmatch(directive, "%S+") do
        tokens[#tokens + 1] = token
    end
    local _, d = _build({ { tokens = tokens, line = nil } })
    if d.gpus ~= nil and d.gpus ~= k then
        _fail("gpus=" .. _int(d.gpus) .. " but the job asks for " .. _int(k) .. " GPUs per node (accepted: gpus=" .. _int(k)
            .. ", or no gpus=: the job's own count)")
    end
    _check_size(d, k)
end

local function _check_submit(job_desc, submit_uid)
    local directive = nil
    local comment = _string_field(job_desc, "comment")
    if comment then
        directive = _directive_in_comment(comment)
    end
    local script = _string_field(job_desc, "script")
    if script then
        local from_script = _parse_script(script)
        if directive == nil then
            directive = from_script
        end
    end
    if directive == nil then
        _add_preference(job_desc, nil, false)
    else
        _check_job_size(job_desc, directive)
        local new_comment = _comment_with_directive(comment, directive)
        if new_comment then
            job_desc.comment = new_comment
        end
        -- `mapa release` finds placement=require in the comment: only a comment it can read.
        local final = new_comment or comment or ""
        local readable = _directive_in_comment_safe(final) == directive and not string.find(final, "[\r\n\30\31]")
        _add_preference(job_desc, directive, readable)
        local record = _COMMENT_PREFIX .. directive
        local existing = _string_field(job_desc, "admin_comment")
        if existing and #existing > _MAX_ADMIN_COMMENT_CHARS then
            slurm.log_info("MAPA: job of uid %s: admin_comment of %d bytes kept as it was (at most %d): %s",
                tostring(submit_uid), #existing, _MAX_ADMIN_COMMENT_CHARS, directive)
            return
        end
        local before = existing and _admin_text(existing) or ""
        if before ~= "" then
            record = before .. " " .. record
        end
        if #record > _MAX_ADMIN_COMMENT_CHARS then
            slurm.log_info("MAPA: job of uid %s: admin_comment kept as it was (%d bytes with the directive, "
                .. "at most %d): %s", tostring(submit_uid), #record, _MAX_ADMIN_COMMENT_CHARS, directive)
            return
        end
        job_desc.admin_comment = record
        slurm.log_debug("MAPA: job of uid %s: %s", tostring(submit_uid), directive)
    end
end

local function _check_modify(job_desc)
    local comment = _string_field(job_desc, "comment")
    if comment then
        _directive_in_comment(comment)
    end
end

function slurm_job_submit(job_desc, part_list, submit_uid)
    return _guarded("job submission", _check_submit, job_desc, submit_uid)
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
    return _guarded("job modification", _check_modify, job_desc)
end

slurm.log_info("job_submit.lua (slurm-mapa MAPA directive validator) initialized")
return slurm.SUCCESS
