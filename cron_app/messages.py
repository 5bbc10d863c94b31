"""What cron answers a sender whose message a rule's StartWorkflow started a workflow for.

The seed's wording (002, "Starting a Workflow"), letter for letter. Cron owns these strings: it
is the room that decides the outcome; the rule engine only hands the answer back.
"""

WORKFLOW_STARTED_FOLLOWS = "Started workflow '{workflow}'. Its result will follow here."
WORKFLOW_STARTED_WEB = "Started workflow '{workflow}'. Its result goes to the workflow's destinations."
WORKFLOW_ALREADY_RUNNING = "Workflow '{workflow}' is already running. Try again when it finishes."
WORKFLOW_TOO_MANY = "Workflow '{workflow}' could not start: too many workflows are running."
WORKFLOW_COULD_NOT_START = "Workflow '{workflow}' could not start: {reason}."
WORKFLOW_CRON_NOT_RUNNING = "Workflow '{workflow}' could not start: cron is not running here."
#: A run that ends otherwise than completed tells the conversation a rule run came from.
WORKFLOW_DID_NOT_FINISH = "Workflow '{workflow}' did not finish: {reason}."
