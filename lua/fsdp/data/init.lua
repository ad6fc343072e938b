--- fsdp.data: datasets, samplers and the DataLoader, with torch.utils.data's names and semantics
-- (indices are 1-based positions, Lua-style, like narrow's start).
--
--   local data = fsdp.data
--   local ds = data.TensorDataset(x, y)                         -- rows of x and y (first dim)
--   local sampler = data.DistributedSampler(ds, {seed = 0})    -- this rank's share, PyTorch's algorithm
--   local loader = data.DataLoader(ds, {batch_size = 64, sampler = sampler, drop_last = true})
--   for epoch = 1, E do
--     loader:set_epoch(epoch)                                   -- reshuffles (seed + epoch)
--     for xb, yb in loader() do ... end                         -- or loader:iter(); #loader batches
--   end
--
-- Dataset: a class with len() and get(i) (i = 1..len()); `data.Dataset:extend("Name")` makes one.
-- A plain Lua list of samples is a dataset too. Samplers (SequentialSampler, RandomSampler,
-- DistributedSampler, taking a dataset or its length; or any object with len() and indices())
-- give the order of one epoch; they keep their epoch and the number of samples handed out in it,
-- so `state_dict()` / `load_state_dict()` resume an epoch exactly where a checkpoint left it.
-- Permutations come from the project's RNG (fsdp.randperm) seeded with seed + epoch, as PyTorch's
-- samplers seed their generator; the global RNG stream is saved and restored around the draw, so
-- iterating a loader leaves fsdp.manual_seed's stream (initialisation, dropout) untouched.
-- @module fsdp.data
local ffi = require "ffi"
local fsdp = require "fsdp"

local M = {}

-- ---- classes ---------------------------------------------------------------------------------------
local function class(name, parent)
  local cls = { __name = name }
  cls.__index = cls
  cls.__len = function(o) return o:len() end  -- for Lua builds that honour __len on tables
  cls.__tostring = function(o) return ("%s(%d)"):format(name, o:len()) end
  return setmetatable(cls, {
    __index = parent,
    __call = function(c, ...)
      local o = setmetatable({}, c)
      o:__init(...)
      return o
    end,
  })
end

local function is_int(v) return type(v) == "number" and v == math.floor(v) and v > -2 ^ 53 and v < 2 ^ 53 end

local function check_opts(what, opts, known)
  if opts == nil then return {} end
  if type(opts) ~= "table" then error(("%s: options must be a table, got a %s"):format(what, type(opts)), 3) end
  for k in pairs(opts) do
    if not known[k] then
      local names = {}
      for n in pairs(known) do names[#names + 1] = n end
      table.sort(names)
      error(("%s: unknown option %s (known: %s)"):format(what, tostring(k), table.concat(names, ", ")), 3)
    end
  end
  return opts
end

local function len_of(dataset, what)
  if type(dataset) == "number" then return fsdp._i(dataset, what, "dataset (a length)", nil, 0) end
  if type(dataset) ~= "table" then
    error(("%s: dataset must be a Dataset (len() and get(i)) or a list of samples, got a %s"):format(what, type(dataset)), 3)
  end
  if type(dataset.len) == "function" then return dataset:len() end
  return fsdp._list(dataset, what, "dataset (a list of samples)", 2)
end

-- ---- datasets --------------------------------------------------------------------------------------
local Dataset = class("Dataset")
M.Dataset = Dataset
--- Dataset(): the base class; a data set defines len() and get(i).
-- @function Dataset
function Dataset:__init() end
--- Dataset:extend("Name") -> a subclass; Name(...) calls its __init
function Dataset.extend(parent, name)
  local cls = class(name, parent)
  cls.extend = Dataset.extend
  return cls
end
--- The number of samples; a Dataset defines it.
function Dataset:len() error(("%s: a Dataset defines len() (the number of samples)"):format(self.__name), 2) end
--- Sample i (1-based); a Dataset defines it.
function Dataset:get() error(("%s: a Dataset defines get(i) (sample i, 1-based)"):format(self.__name), 2) end

-- TensorDataset(x, y, ...): sample i is {x[i], y[i], ...} (rows along the first dim)
local TensorDataset = Dataset:extend("TensorDataset")
M.TensorDataset = TensorDataset
--- TensorDataset(t1, t2, ...): sample i is {t1[i], t2[i], ...} (all tensors have the same dim-1 size).
-- @function TensorDataset
function TensorDataset:__init(...)
  local n = select("#", ...)
  if n == 0 then error("TensorDataset: expected at least one tensor", 3) end
  self.tensors = {}
  for i = 1, n do
    local t = select(i, ...)
    if not fsdp.is_tensor(t) then error(("TensorDataset: argument %d must be a tensor, got a %s"):format(i, type(t)), 3) end
    if t:dim() < 1 then error(("TensorDataset: argument %d is a 0-dim tensor (samples run along the first dim)"):format(i), 3) end
    if i > 1 and t:size(1) ~= self.tensors[1]:size(1) then
      error(("TensorDataset: size mismatch between tensors: argument 1 has %d rows, argument %d has %d")
        :format(self.tensors[1]:size(1), i, t:size(1)), 3)
    end
    self.tensors[i] = t
  end
end
--- The number of samples (the tensors' dim-1 size).
function TensorDataset:len() return (self.tensors[1]:size(1)) end
--- Sample i (1-based): a list of one row of each tensor.
-- @param i the index
function TensorDataset:get(i)
  local n = self:len()
  if not is_int(i) or i < 1 or i > n then
    error(("TensorDataset: index %s is out of range 1..%d"):format(tostring(i), n), 2)
  end
  local out = {}
  for k, t in ipairs(self.tensors) do
    local s = t:shape()
    table.remove(s, 1)
    out[k] = t:narrow(1, i, 1):reshape(s)
  end
  return out
end
-- the rows of a batch at once: `first` (consecutive rows first..first+len-1: one copy of the
-- block) or the 0-based int64 index tensor ix (index_select); the list of the tensors' batches.
-- New tensors either way, as PyTorch's default_collate stacks: a batch changed in place (xb:mul_(s),
-- xb[i] = v) must not change the data set (a view did, and the next epoch read the changed rows)
function TensorDataset:_batch(first, len, ix)
  local out = {}
  for k, t in ipairs(self.tensors) do
    if first then out[k] = t:narrow(1, first, len):clone()
    else
      if ix.device ~= t.device then ix = ix:to(t.device) end
      out[k] = t:index_select(1, ix)
    end
  end
  return out
end

-- ---- permutations ------------------------------------------------------------------------------------
--- a Lua list of 1..n in the order of fsdp.randperm(n) after fsdp.manual_seed(seed); the global
-- RNG stream is left as it was
function M.randperm(n, seed)
  if not is_int(n) or n < 0 then error(("fsdp.data.randperm: n must be an integer >= 0, got %s"):format(tostring(n)), 2) end
  if not is_int(seed) or seed < 0 then error(("fsdp.data.randperm: seed must be an integer >= 0, got %s"):format(tostring(seed)), 2) end
  local out = {}
  if n == 0 then return out end
  local saved = fsdp.get_rng_state()
  fsdp.manual_seed(seed)
  local ok, p = pcall(fsdp.randperm, n)
  fsdp.set_rng_state(saved)
  if not ok then error(p, 0) end
  local ptr = ffi.cast("const int64_t*", p:data_ptr())
  for i = 0, n - 1 do out[i + 1] = tonumber(ptr[i]) + 1 end
  return out
end

-- ---- samplers -------------------------------------------------------------------------------------------
-- The base: epoch (set_epoch), pos (samples handed out in this epoch) and a pending resume
-- position from load_state_dict; a subclass defines _order() -> the list of one epoch's indices.
local Sampler = class("Sampler")
M.Sampler = Sampler
--- Sampler:extend("Name") -> a subclass.
-- @param parent the class
-- @param name the class's name
function Sampler.extend(parent, name)
  local cls = class(name, parent)
  cls.extend = Sampler.extend
  return cls
end
function Sampler:_base_init()
  self.epoch, self.pos, self._resume = 0, 0, nil
end
--- The number of indices per epoch.
function Sampler:len() return #self:_order() end
--- Sets the epoch (a shuffling sampler's order depends on it).
-- @param epoch an integer
function Sampler:set_epoch(epoch)
  if not is_int(epoch) then error(("%s:set_epoch: epoch must be an integer, got %s"):format(self.__name, tostring(epoch)), 2) end
  -- a resumed position stays for the epoch it was saved in
  if self._resume and self._resume.epoch ~= epoch then self._resume = nil end
  if epoch ~= self.epoch then self.pos = 0 end
  self.epoch = epoch
end
--- the indices of the current epoch, and the position to start at (0 unless resuming)
function Sampler:indices() return self:_order() end
function Sampler:_start()
  local r = self._resume
  self._resume = nil
  if r and r.epoch == self.epoch then return r.pos end
  return 0
end
-- called by the loader (or iter) as samples go out / when an epoch's pass ends
function Sampler:_advance(n) self.pos = self.pos + n end
function Sampler:_finished() end
--- The sampler's position: {epoch =, pos =}.
function Sampler:state_dict() return { epoch = self.epoch, pos = self.pos } end
--- Restores the position state_dict() returned.
-- @param sd the state table
function Sampler:load_state_dict(sd)
  if type(sd) ~= "table" or not is_int(sd.epoch) or not is_int(sd.pos) or sd.pos < 0 then
    error(("%s:load_state_dict: expected {epoch = int, pos = int >= 0}, got %s"):format(self.__name,
      type(sd) == "table" and ("{epoch = %s, pos = %s}"):format(tostring(sd.epoch), tostring(sd.pos)) or type(sd)), 2)
  end
  self.epoch, self.pos = sd.epoch, sd.pos
  self._resume = { epoch = sd.epoch, pos = sd.pos }
end
--- for i in sampler:iter(): the remaining indices of the epoch, one at a time
function Sampler:iter()
  local idx = self:indices()
  local k = self:_start()
  self.pos = k
  return function()
    if k >= #idx then self:_finished() return nil end
    k = k + 1
    self:_advance(1)
    return idx[k]
  end
end

-- SequentialSampler(dataset): 1, 2, ..., len
local SequentialSampler = Sampler:extend("SequentialSampler")
M.SequentialSampler = SequentialSampler
--- SequentialSampler(dataset): the indices 1..n in order.
-- @function SequentialSampler
function SequentialSampler:__init(dataset)
  self.n = len_of(dataset, "SequentialSampler")
  self:_base_init()
end
--- The number of indices per epoch.
function SequentialSampler:len() return self.n end
function SequentialSampler:_order()
  local out = {}
  for i = 1, self.n do out[i] = i end
  return out
end

-- RandomSampler(dataset, {seed = s}): a permutation per epoch from seed + epoch. Without set_epoch
-- each completed pass moves to the next epoch, so every pass is shuffled anew (as PyTorch's
-- RandomSampler draws a new order each time); without a seed one is drawn from the global RNG
-- (fsdp.manual_seed fixes it).
local RandomSampler = Sampler:extend("RandomSampler")
M.RandomSampler = RandomSampler
local function default_seed() return (fsdp.randint(0, 2 ^ 31 - 1, { 1 }):item()) end
--- RandomSampler(dataset[, {seed = 0}]): the indices in a random order, a new one each epoch.
-- @function RandomSampler
function RandomSampler:__init(dataset, opts)
  opts = check_opts("RandomSampler", opts, { seed = true })
  self.n = len_of(dataset, "RandomSampler")
  if opts.seed ~= nil and (not is_int(opts.seed) or opts.seed < 0) then
    error(("RandomSampler: seed must be an integer >= 0, got %s"):format(tostring(opts.seed)), 3)
  end
  self.seed = opts.seed or default_seed()
  self:_base_init()
end
--- The number of indices per epoch.
function RandomSampler:len() return self.n end
function RandomSampler:_order() return M.randperm(self.n, self.seed + self.epoch) end
function RandomSampler:_finished() self.epoch, self.pos = self.epoch + 1, 0 end  -- (a drop_last tail too)

-- DistributedSampler(dataset, {num_replicas, rank, shuffle = true, seed = 0, drop_last = false}):
-- torch.utils.data.DistributedSampler's algorithm. The epoch's order (a permutation from
-- seed + epoch, the same on every rank, or 1..n) is padded by repeating its beginning to a
-- multiple of num_replicas (drop_last: cut to one instead), and rank r takes every
-- num_replicas-th index from position r + 1: distinct samples, the same count on every rank.
local DistributedSampler = Sampler:extend("DistributedSampler")
M.DistributedSampler = DistributedSampler
--- DistributedSampler(dataset[, {num_replicas, rank, shuffle = true, seed = 0, drop_last = false}]): this rank's share of the indices.
-- @function DistributedSampler
function DistributedSampler:__init(dataset, opts)
  opts = check_opts("DistributedSampler", opts, { num_replicas = true, rank = true, shuffle = true, seed = true, drop_last = true })
  self.n = len_of(dataset, "DistributedSampler")
  local inited = fsdp.comm.is_initialized()
  local N = opts.num_replicas
  if N == nil then N = inited and fsdp.world_size() or 1 end
  local r = opts.rank
  if r == nil then r = inited and fsdp.rank() or 0 end
  if not is_int(N) or N < 1 then error(("DistributedSampler: num_replicas must be an integer >= 1, got %s"):format(tostring(N)), 3) end
  if not is_int(r) or r < 0 or r >= N then
    error(("DistributedSampler: invalid rank %s, rank should be in the interval [0, %d]"):format(tostring(r), N - 1), 3)
  end
  local seed = opts.seed == nil and 0 or opts.seed
  if not is_int(seed) or seed < 0 then error(("DistributedSampler: seed must be an integer >= 0, got %s"):format(tostring(seed)), 3) end
  self.num_replicas, self.rank, self.seed = N, r, seed
  self.shuffle = opts.shuffle ~= false
  self.drop_last = opts.drop_last == true
  local n = self.n
  if self.drop_last and n % N ~= 0 then
    self.num_samples = math.ceil((n - N) / N)
  else
    self.num_samples = math.ceil(n / N)
  end
  self.total_size = self.num_samples * N
  self:_base_init()
end
--- The number of indices this rank gets per epoch.
function DistributedSampler:len() return self.num_samples end
function DistributedSampler:_order()
  local n, total = self.n, self.total_size
  local idx
  if self.shuffle then idx = M.randperm(n, self.seed + self.epoch)
  else
    idx = {}
    for i = 1, n do idx[i] = i end
  end
  if not self.drop_last then  -- pad by repeating the beginning (the whole list again if short)
    local k = 1
    while #idx < total and n > 0 do
      idx[#idx + 1] = idx[k]
      k = k + 1
    end
  end
  local out = {}
  for i = self.rank + 1, total, self.num_replicas do out[#out + 1] = idx[i] end
  return out
end

-- ---- collation --------------------------------------------------------------------------------------------
local function is_list(t)
  if type(t) ~= "table" or fsdp.is_tensor(t) then return false end
  local n = 0
  for _ in pairs(t) do n = n + 1 end
  return n > 0 and n == #t
end

--- default_collate(samples): tensors stacked along a new first dim, numbers into a tensor (int64
-- when all are integers, else float32), strings and booleans kept in a list, lists and string-keyed
-- tables collated field by field (as torch.utils.data.default_collate)
function M.default_collate(samples)
  if type(samples) ~= "table" or fsdp._list(samples, "default_collate", "samples") == 0 then
    error(("default_collate: expected a non-empty list of samples, got %s"):format(type(samples)), 2)
  end
  local first = samples[1]
  if fsdp.is_tensor(first) then
    local rows = {}
    for i, s in ipairs(samples) do
      if not fsdp.is_tensor(s) then error(("default_collate: sample %d is a %s, sample 1 a tensor"):format(i, type(s)), 2) end
      local shape = s:shape()
      table.insert(shape, 1, 1)
      rows[i] = s:reshape(shape)
    end
    return fsdp.cat(rows, 1)
  elseif type(first) == "number" then
    local ints = true
    for i, s in ipairs(samples) do
      if type(s) ~= "number" then error(("default_collate: sample %d is a %s, sample 1 a number"):format(i, type(s)), 2) end
      ints = ints and is_int(s)
    end
    return fsdp.tensor(samples, ints and "int64" or "float32")
  elseif type(first) == "table" then
    local out = {}
    for k in pairs(first) do
      local col = {}
      for i, s in ipairs(samples) do
        if type(s) ~= "table" or s[k] == nil then
          error(("default_collate: sample %d has no field %s (sample 1 has)"):format(i, tostring(k)), 2)
        end
        col[i] = s[k]
      end
      out[k] = M.default_collate(col)
    end
    return out
  end
  local out = {}
  for i, s in ipairs(samples) do out[i] = s end
  return out
end

-- ---- the loader -----------------------------------------------------------------------------------------
local Loader = {}
Loader.__index = Loader

local loader_opts = { batch_size = true, shuffle = true, drop_last = true, sampler = true, collate_fn = true,
  seed = true, num_workers = true, prefetch_factor = true, persistent_workers = true, worker_init_fn = true,
  pin_memory = true }

local pin_warned = false
-- whether pinned host memory is there: it is the GPU backend's ("cuda" loaded, or a test's stand-in)
local function has_gpu()
  for _, name in ipairs(fsdp.backends()) do
    if name == "cuda" then return true end
  end
  return false
end
-- v with every CPU tensor in it pinned (x:pin_memory()): tables are copied (keeping their metatable,
-- a table met twice gives one copy), everything else stays itself
local function pinned(v, seen)
  if fsdp.is_tensor(v) then return v.device == "cpu" and v:pin_memory() or v end
  if type(v) ~= "table" then return v end
  if seen[v] then return seen[v] end
  local out = setmetatable({}, getmetatable(v))
  seen[v] = out
  for k, x in pairs(v) do out[k] = pinned(x, seen) end
  return out
end

--- DataLoader(dataset, {batch_size = 1, shuffle = false, drop_last = false, sampler = nil,
-- collate_fn = default_collate, seed = nil, num_workers = 0, prefetch_factor = 2,
-- persistent_workers = false, worker_init_fn = nil, pin_memory = false}).
-- `#loader` and loader:len() count the batches; `for ... in loader() do` (or loader:iter())
-- yields each batch, unpacked when it is a list (a TensorDataset(x, y) gives xb, yb).
-- num_workers = N > 0: N worker processes (fork) build batches ahead of the training loop, batch i
-- in worker (i - 1) % N, at most prefetch_factor batches per worker ahead; the batches and their
-- order are those of num_workers = 0. Each iteration draws a base seed from the global RNG (as
-- PyTorch does; num_workers = 0 draws nothing), and worker id (0-based, as PyTorch's) seeds its
-- fsdp.manual_seed and math.randomseed with base seed + id, then calls worker_init_fn(id);
-- get_worker_info() tells the worker who it is. persistent_workers = true keeps the workers
-- across epochs (they keep the dataset as it was when they started). A batch is made of tensors
-- (CPU), numbers, strings, booleans and plain tables of them (metatables stay behind).
-- pin_memory = true: where a GPU is there, every CPU tensor of each batch (in nested tables too)
-- comes back copied into pinned host memory (x:pin_memory(); its :to("cuda") is a direct copy),
-- in this process, after the workers' batches arrive; without one, batches stay as they are, said once.
-- @param dataset a Dataset or a list of samples
-- @param opts the options
function M.DataLoader(dataset, opts)
  opts = check_opts("DataLoader", opts, loader_opts)
  if type(dataset) ~= "table" then
    error(("DataLoader: dataset must be a Dataset (len() and get(i)) or a list of samples, got a %s"):format(type(dataset)), 2)
  end
  local self = setmetatable({ dataset = dataset }, Loader)
  local bs = opts.batch_size == nil and 1 or opts.batch_size
  if not is_int(bs) or bs < 1 then error(("DataLoader: batch_size must be an integer >= 1, got %s"):format(tostring(bs)), 2) end
  self.batch_size = bs
  self.drop_last = opts.drop_last == true
  if opts.collate_fn ~= nil and type(opts.collate_fn) ~= "function" then
    error(("DataLoader: collate_fn must be a function, got a %s"):format(type(opts.collate_fn)), 2)
  end
  self.collate_fn = opts.collate_fn or M.default_collate
  local nw = opts.num_workers == nil and 0 or opts.num_workers
  if not is_int(nw) or nw < 0 then
    error(("DataLoader: num_workers must be an integer >= 0 (0 loads in this process), got %s"):format(tostring(nw)), 2)
  end
  self.num_workers = nw
  if opts.prefetch_factor ~= nil then
    if nw == 0 then error("DataLoader: prefetch_factor needs num_workers > 0 (it counts batches per worker)", 2) end
    if not is_int(opts.prefetch_factor) or opts.prefetch_factor < 1 then
      error(("DataLoader: prefetch_factor must be an integer >= 1, got %s"):format(tostring(opts.prefetch_factor)), 2)
    end
  end
  self.prefetch_factor = opts.prefetch_factor or 2
  if opts.persistent_workers ~= nil and type(opts.persistent_workers) ~= "boolean" then
    error(("DataLoader: persistent_workers must be a boolean, got a %s"):format(type(opts.persistent_workers)), 2)
  end
  if opts.persistent_workers and nw == 0 then error("DataLoader: persistent_workers = true needs num_workers > 0", 2) end
  self.persistent_workers = opts.persistent_workers == true
  if opts.worker_init_fn ~= nil and type(opts.worker_init_fn) ~= "function" then
    error(("DataLoader: worker_init_fn must be a function, got a %s"):format(type(opts.worker_init_fn)), 2)
  end
  self.worker_init_fn = opts.worker_init_fn
  if opts.pin_memory ~= nil and type(opts.pin_memory) ~= "boolean" then
    error(("DataLoader: pin_memory must be a boolean, got a %s"):format(type(opts.pin_memory)), 2)
  end
  self.pin_memory = opts.pin_memory == true and has_gpu()
  if opts.pin_memory and not self.pin_memory and not pin_warned then
    pin_warned = true
    io.stderr:write(("fsdp.data.DataLoader: pin_memory = true does nothing here: there is no GPU (%s); "
      .. "batches stay in pageable memory\n"):format(fsdp.cuda.why_not()))
  end
  if opts.sampler ~= nil then
    if opts.shuffle then error("DataLoader: sampler option is mutually exclusive with shuffle", 2) end
    local s = opts.sampler
    if type(s) ~= "table" or type(s.indices) ~= "function" or type(s.len) ~= "function" then
      error("DataLoader: sampler must be a sampler (an object with len() and indices())", 2)
    end
    if opts.seed ~= nil then error("DataLoader: seed is for shuffle = true; give the sampler its seed", 2) end
    self.sampler = s
  elseif opts.shuffle then
    self.sampler = RandomSampler(dataset, { seed = opts.seed })
  else
    self.sampler = SequentialSampler(dataset)
  end
  -- userdata, so that `#loader` works in LuaJIT (which ignores __len on tables)
  local proxy = newproxy(true)
  local mt = getmetatable(proxy)
  mt.__index, mt.__newindex = self, self
  mt.__len = function() return self:len() end
  mt.__call = function(_, ...) return self:iter(...) end
  mt.__tostring = function() return ("DataLoader(%d batches of %d)"):format(self:len(), self.batch_size) end
  return proxy
end

--- get_worker_info() -> {id =, num_workers =, seed =, dataset =} inside a DataLoader worker
-- process (id 0-based, as PyTorch's), nil in the main process.
function M.get_worker_info() return M._worker_info end

function Loader:len()
  local n = self.sampler:len()
  if self.drop_last then return math.floor(n / self.batch_size) end
  return math.ceil(n / self.batch_size)
end
function Loader:set_epoch(epoch)
  if type(self.sampler.set_epoch) == "function" then self.sampler:set_epoch(epoch) end
end
function Loader:state_dict()
  local s = self.sampler
  return { sampler = type(s.state_dict) == "function" and s:state_dict() or nil }
end
function Loader:load_state_dict(sd)
  if type(sd) ~= "table" then error(("DataLoader:load_state_dict: expected a table, got a %s"):format(type(sd)), 2) end
  if sd.sampler ~= nil then
    if type(self.sampler.load_state_dict) ~= "function" then error("DataLoader:load_state_dict: the sampler keeps no state", 2) end
    self.sampler:load_state_dict(sd.sampler)
  end
end

-- the batch as the loop gets it: pinned with pin_memory = true (where a GPU is), else itself
function Loader:_pin(batch)
  if not self.pin_memory then return batch end
  return pinned(batch, {})
end

-- the yielded values of a batch: a list's elements, anything else itself
local function yield(batch)
  if is_list(batch) then return unpack(batch, 1, #batch) end
  return batch
end

-- the builder of one batch: fn(idx, k, len, ix) -> the batch of samples idx[k + 1 .. k + len]; ix,
-- the 0-based int64 tensor of idx (made by index_tensor), serves a TensorDataset with the default
-- collation (rows at once: a block copy when consecutive, else index_select); the same function builds a
-- batch in this process and in a worker
local function index_tensor(ds, idx)
  local n = #idx
  local buf = ffi.new("int64_t[?]", n)
  for i = 1, n do buf[i - 1] = idx[i] - 1 end
  local ix = fsdp.empty({ n }, { dtype = "int64" })
  ffi.copy(ix:data_ptr(), buf, n * 8)
  local t1 = ds.tensors and ds.tensors[1]
  if t1 and t1.device ~= "cpu" then ix = ix:to(t1.device) end  -- one move per epoch
  return ix
end
function Loader:_batch_fn()
  local ds = self.dataset
  local fast = self.collate_fn == M.default_collate and getmetatable(ds) ~= nil and type(ds._batch) == "function"
  local get = type(ds.get) == "function" and function(i) return ds:get(i) end or function(i) return ds[i] end
  return function(idx, k, len, ix)
    if fast then
      local consecutive = true
      for j = k + 2, k + len do
        if idx[j] ~= idx[j - 1] + 1 then consecutive = false break end
      end
      if consecutive then return ds:_batch(idx[k + 1], len) end
      ix = ix or index_tensor(ds, idx)
      return ds:_batch(nil, len, ix:narrow(1, k + 1, len))
    end
    local samples = {}
    for j = 1, len do samples[j] = get(idx[k + j]) end
    return self.collate_fn(samples)
  end, fast
end

-- the worker pool of an iteration: the loader's own with persistent_workers (started once, reset
-- per epoch), else a new one that ends with the epoch or with its iterator
function Loader:_pool()
  local workers = require "fsdp.data.workers"
  if self._workers and not self._workers.closed and self._workers:new_epoch() then return self._workers end
  local make_batch = self:_batch_fn()
  local pool = workers.start { n = self.num_workers, prefetch = self.prefetch_factor, dataset = self.dataset,
    init_fn = self.worker_init_fn, base_seed = (fsdp.randint(0, 2 ^ 31 - 1, { 1 }):item()),
    make_batch = function(list) return make_batch(list, 0, #list) end }
  if self.persistent_workers then self._workers = pool end
  return pool
end

function Loader:iter()
  local s, bs = self.sampler, self.batch_size
  local idx = s:indices()
  local k = type(s._start) == "function" and s:_start() or 0
  if s.pos ~= nil then s.pos = k end
  local n = #idx
  -- the epoch's batches: their first position in idx and their length
  local firsts, lens = {}, {}
  for j = k, n - 1, bs do
    local len = math.min(bs, n - j)
    if self.drop_last and len < bs then break end
    firsts[#firsts + 1], lens[#lens + 1] = j, len
  end
  local nb, b = #firsts, 0
  local function finish()
    if type(s._finished) == "function" then s:_finished() end
    return nil
  end
  if self.num_workers == 0 then
    local make_batch, fast = self:_batch_fn()
    local ix = fast and n > 0 and index_tensor(self.dataset, idx) or nil  -- the epoch's indices, once
    return function()
      if b >= nb then
        if b == nb then b = b + 1; return finish() end
        return nil
      end
      b = b + 1
      local batch = make_batch(idx, firsts[b], lens[b], ix)
      if type(s._advance) == "function" then s:_advance(lens[b]) end
      return yield(self:_pin(batch))
    end
  end
  local pool = self:_pool()
  local sent, ahead = 0, self.num_workers * self.prefetch_factor
  local function send_more()
    while sent < nb and sent - b < ahead do
      sent = sent + 1
      pool:send(idx, firsts[sent], lens[sent])
    end
  end
  local ok, err = pcall(send_more)
  if not ok then
    pool:shutdown()
    error(err, 0)
  end
  return function()
    if b >= nb then
      if b == nb then
        b = b + 1
        if not self.persistent_workers then pool:shutdown() end
        return finish()
      end
      return nil
    end
    b = b + 1
    local got, batch = pcall(function()
      local out = pool:take()
      send_more()
      return out
    end)
    if not got then
      b = nb + 1  -- the iteration ends here; the next one starts new workers
      pool:shutdown()
      error(batch, 0)
    end
    if type(s._advance) == "function" then s:_advance(lens[b]) end
    return yield(self:_pin(batch))
  end
end

return M
