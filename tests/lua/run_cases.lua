--[[
Test driver for slurm_mapa/data/slurm/job_submit.lua under a plain Lua 5.1 interpreter.

    lua5.1 tests/lua/run_cases.lua PLUGIN CASES > RESULTS

It loads PLUGIN with a mocked `slurm` table (log_user collects the messages the user would see,
formatted with string.format as Slurm does; the other log functions are no-ops that still format
their arguments), then runs every case of the binary file CASES through the plugin.

CASES: a sequence of records "MODE SCRIPT_LEN COMMENT_LEN\n" followed by SCRIPT_LEN bytes of
job_desc.script and COMMENT_LEN bytes of job_desc.comment (a length of -1 means the field is nil).
MODE is one of
    submit    slurm_job_submit(job_desc, {}, 1000)
    modify    slurm_job_modify(job_desc, {}, {}, 1000)
    boom      slurm_job_submit with a job_desc whose every field read raises a Lua error
    noeslurm  submit with the slurm.ESLURM_* codes removed from the mock
    number    submit with job_desc.script and job_desc.comment set to numbers (non-strings)

RESULTS: first "LOAD RC\n", then "GLOBALS name,name,...\n" (globals the plugin defined), then
"INFO N\n" and N records "LEN\n" + bytes (what the plugin logged at info level while loading);
then, per case, "RC NMSG ADMIN_LEN COMMENT_LEN PREFER_LEN PLACE_LEN\n", NMSG records "LEN\n" + bytes
(the log_user messages), ADMIN_LEN bytes of job_desc.admin_comment after the call (-1: nil),
COMMENT_LEN bytes of job_desc.comment when the call changed it (-1: unchanged), PREFER_LEN bytes
of job_desc.prefer (-1: nil) and PLACE_LEN bytes of "features=<job_desc.features> begin=<seconds
from now of job_desc.begin_time>" (either empty when unset). Modes gpus4, gpus3, gpus4typed,
gpus4user, gpus4and, gpus4or, gpus4mapa, gpus4begin, gpus4pinned set tres_per_node (gpus2job,
gpus2job1: tres_per_job, on any number of nodes or on one) (and the user's own prefer, constraint
or begin time) before a submit.
--]]

local plugin_path, cases_path = arg[1], arg[2]
assert(plugin_path and cases_path, "usage: run_cases.lua PLUGIN CASES")

local ESLURM = { ESLURM_INVALID_GRES = 2072, ESLURM_INTERNAL = 2090 }
local user_messages, info_messages = {}, {}

local function _format(fmt, ...)
    return string.format(fmt, ...)
end

slurm = {
    SUCCESS = 0,
    ERROR = -1,
    FAILURE = -1,
    log_user = function(fmt, ...)
        user_messages[#user_messages + 1] = _format(fmt, ...)
    end,
    log_info = function(fmt, ...)
        info_messages[#info_messages + 1] = _format(fmt, ...)
    end,
    log_debug = function(fmt, ...)
        _format(fmt, ...)
    end,
    log_error = function(fmt, ...)
        _format(fmt, ...)
    end,
}
for name, value in pairs(ESLURM) do
    slurm[name] = value
end

local before = {}
for name in pairs(_G) do
    before[name] = true
end
local chunk = assert(loadfile(plugin_path))
local load_rc = chunk()
local added = {}
for name in pairs(_G) do
    if not before[name] then
        added[#added + 1] = name
    end
end
table.sort(added)

local out = {}
local function emit(text)
    out[#out + 1] = text
end
local function emit_blob(text)
    emit(string.format("%d\n", #text))
    emit(text)
end

emit("LOAD " .. tostring(load_rc) .. "\n")
emit("GLOBALS " .. table.concat(added, ",") .. "\n")
emit(string.format("INFO %d\n", #info_messages))
for _, message in ipairs(info_messages) do
    emit_blob(message)
end

local file = assert(io.open(cases_path, "rb"))
local data = file:read("*a")
file:close()

local position = 1
local function take(count)
    if count < 0 then
        return nil
    end
    local text = string.sub(data, position, position + count - 1)
    assert(#text == count, "truncated cases file")
    position = position + count
    return text
end

while position <= #data do
    local header_end = assert(string.find(data, "\n", position, true), "bad case header")
    local mode, script_len, comment_len = string.match(string.sub(data, position, header_end - 1), "^(%w+) (%-?%d+) (%-?%d+)$")
    assert(mode, "bad case header")
    position = header_end + 1
    local script, comment = take(tonumber(script_len)), take(tonumber(comment_len))

    user_messages = {}
    local job_desc = { script = script, comment = comment }
    local rc
    if mode == "submit" then
        rc = slurm_job_submit(job_desc, {}, 1000)
    elseif mode == "modify" then
        rc = slurm_job_modify(job_desc, {}, {}, 1000)
    elseif mode == "boom" then
        local trap = setmetatable({}, { __index = function(_, key)
            error("mock: reading job_desc." .. tostring(key) .. " failed")
        end })
        rc = slurm_job_submit(trap, {}, 1000)
    elseif mode == "noeslurm" then
        for name in pairs(ESLURM) do
            slurm[name] = nil
        end
        rc = slurm_job_submit(job_desc, {}, 1000)
        for name, value in pairs(ESLURM) do
            slurm[name] = value
        end
    elseif string.sub(mode, 1, 4) == "gpus" then
        -- --gres=gpu:4 (gpus3: 3, gpus4typed: gpu:v100:4; gpus4user: the user's own --prefer too,
        -- gpus4and / gpus4or / gpus4mapa: their own --constraint, gpus4begin: their own --begin, gpus4pinned: -w)
        job_desc.tres_per_node = ({ gpus3 = "gres/gpu:3", gpus4typed = "gres/shard:1,gres/gpu:v100:4" })[mode] or "gres/gpu:4"
        if mode == "gpus2job" or mode == "gpus2job1" then
            -- --gpus=2, on one node (-N 1: max_nodes 1) or on as many as Slurm likes
            job_desc.tres_per_node, job_desc.tres_per_job = nil, "gres/gpu:2"
            job_desc.max_nodes = mode == "gpus2job1" and 1 or 4294967294
        end
        if mode == "gpus4user" then
            job_desc.prefer = "bigmem"
        elseif mode == "gpus4and" then
            job_desc.features = "bigmem&ib"
        elseif mode == "gpus4or" then
            job_desc.features = "bigmem|ib"
        elseif mode == "gpus4mapa" then
            job_desc.features = "ib&mapa_ring4"
        elseif mode == "gpus4begin" then
            job_desc.begin_time = os.time() + 7200
        elseif mode == "gpus4pinned" then
            job_desc.req_nodes = "dgx1"
        else
            job_desc.begin_time = 0 -- what Slurm hands the plugin when the user gave no --begin
        end
        rc = slurm_job_submit(job_desc, {}, 1000)
    elseif mode == "number" then
        job_desc = { script = 42, comment = 7 }
        rc = slurm_job_submit(job_desc, {}, 1000)
    else
        error("unknown mode " .. mode)
    end

    local admin = rawget(job_desc, "admin_comment")
    local after = rawget(job_desc, "comment")
    if type(after) ~= "string" or after == comment then
        after = nil -- unchanged
    end
    local prefer = rawget(job_desc, "prefer")
    if type(prefer) ~= "string" then
        prefer = nil
    end
    local features, begin = rawget(job_desc, "features"), rawget(job_desc, "begin_time")
    local place = "features=" .. (type(features) == "string" and features or "") .. " begin="
        .. ((type(begin) == "number" and begin > 0) and string.format("%d", begin - os.time()) or "")
    emit(string.format("%s %d %d %d %d %d\n", tostring(rc), #user_messages, admin and #admin or -1, after and #after or -1,
        prefer and #prefer or -1, #place))
    for _, message in ipairs(user_messages) do
        emit_blob(message)
    end
    if admin then
        emit(admin)
    end
    if after then
        emit(after)
    end
    if prefer then
        emit(prefer)
    end
    emit(place)
end

io.stdout:write(table.concat(out))
