-- Argo CD health check for daedalus.dev/RLTrainingJob.
-- Install as argocd-cm key `resource.customizations.health.daedalus.dev_RLTrainingJob` (see charts/daedalus/README.md).
--
-- Reads status.conditions (metav1.Condition: Ready, Reconciling, Stalled as kstatus reads them, plus Succeeded,
-- Failed, Suspended), status.observedGeneration and status.phase. Order, as kstatus does it
-- (https://github.com/kubernetes-sigs/cli-utils/blob/master/pkg/kstatus/README.md), with the terminal conditions first:
--   1. generation not observed yet (status or any condition older than metadata.generation) -> Progressing
--   2. Failed=True or phase Failed                       -> Degraded (the condition's message)
--   3. Succeeded=True or phase Succeeded                 -> Healthy
--   4. Reconciling=True                                  -> Progressing
--   5. Stalled=True                                      -> Degraded
--   6. Suspended=True or phase Suspended                 -> Suspended
--   7. Ready=True (phase Running)                        -> Healthy
--   8. anything else (Pending, Provisioning, ...)        -> Progressing
local hs = {}

local function condition_message(c, fallback)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    if c.reason ~= nil and c.reason ~= "" then
      return c.reason .. ": " .. c.message
    end
    return c.message
  end
  if c ~= nil and c.reason ~= nil and c.reason ~= "" then
    return c.reason
  end
  return fallback
end

if obj.status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report status"
  return hs
end

local status = obj.status
local generation = nil
if obj.metadata ~= nil then
  generation = obj.metadata.generation
end

local conditions = {}
local stale = nil
if status.conditions ~= nil then
  for _, c in ipairs(status.conditions) do
    if c.type ~= nil then
      conditions[c.type] = c
      if generation ~= nil and c.observedGeneration ~= nil and c.observedGeneration < generation then
        stale = c
      end
    end
  end
end

local function is_true(kind)
  return conditions[kind] ~= nil and conditions[kind].status == "True"
end

local phase = status.phase or ""

-- 1. The operator has not reconciled the current spec yet.
if generation ~= nil and status.observedGeneration ~= nil and status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation) ..
    " (observed " .. tostring(status.observedGeneration) .. ")"
  return hs
end
if stale ~= nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation) ..
    " (condition " .. stale.type .. " is from generation " .. tostring(stale.observedGeneration) .. ")"
  return hs
end

-- 2. Terminal failure.
if is_true("Failed") or phase == "Failed" then
  local fallback = "Training job failed"
  if status.lastFailure ~= nil and status.lastFailure.message ~= nil then
    fallback = status.lastFailure.message
  end
  hs.status = "Degraded"
  hs.message = condition_message(conditions["Failed"], fallback)
  return hs
end

-- 3. Terminal success.
if is_true("Succeeded") or phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = condition_message(conditions["Succeeded"], "Training job succeeded")
  return hs
end

-- 4. Work in progress (provisioning, recovering, checkpointing).
if is_true("Reconciling") then
  hs.status = "Progressing"
  hs.message = condition_message(conditions["Reconciling"], "Reconciling")
  return hs
end

-- 5. Stalled without Failed: this operator sets Stalled only with Failed (step 2); kept for kstatus-style statuses.
if is_true("Stalled") then
  hs.status = "Degraded"
  hs.message = condition_message(conditions["Stalled"], "Stalled")
  return hs
end

-- 6. Suspended by spec.suspend.
if is_true("Suspended") or phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = condition_message(conditions["Suspended"], "Suspended")
  return hs
end

-- 7. Training.
if is_true("Ready") then
  hs.status = "Healthy"
  local message = condition_message(conditions["Ready"], "Running")
  -- the operator's own Ready message says "step N/M" already; a message without one gets the status' figures
  if status.currentStep ~= nil and status.totalSteps ~= nil and not string.find(message, "step %d+/%d+") then
    message = message .. " (step " .. tostring(status.currentStep) .. "/" .. tostring(status.totalSteps) .. ")"
  end
  hs.message = message
  return hs
end

-- 8. Pending, Provisioning, or a status without conditions yet.
hs.status = "Progressing"
if phase ~= "" then
  hs.message = condition_message(conditions["Ready"], "Phase " .. phase)
else
  hs.message = condition_message(conditions["Ready"], "Waiting for the operator")
end
return hs
